#!/usr/bin/env python3
"""Served throughput against the in-process ceiling, interleaved in one run.

Each round runs two windows back to back:
  served      locust (headless, closed loop, N users) drives the running stack through nginx
              over the shared corpus, one or more texts per request;
  in-process  the same model, dtype, thread count and batch policy (read from the same config
              as the server), on the same corpus texts grouped the way the server sees them
              at that concurrency: consecutive chunks of users x texts-per-request texts, each
              chunk split into batches by gpu_workers.batcher.form_batch. No serving.
This machine's speed drifts, so the figure quoted is the median over rounds of the ratio
served / in-process, each ratio taken from adjacent windows, with its spread.

Usage (the stack must be up: scripts/serve):
  .venv/bin/python scripts/bench.py --users 32 --texts 1 --window 20 --rounds 3
Writes bench-results/bench-<time>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpu_workers.batcher import Limits, form_batch  # noqa: E402
from shmserve import config as config_mod  # noqa: E402
from shmserve.models import inspect  # noqa: E402

CORPUS = REPO.parent / "shared" / "bench" / "corpus.json"


@dataclass(eq=False)
class Text:
    length: int
    ids: np.ndarray
    model: str = "m"
    priority: int = 0
    arrived: float = 0.0


def served_window(args, out_dir: Path, label: str) -> dict:
    prefix = out_dir / label
    env = {**os.environ, "SHMSERVE_BENCH_TEXTS": str(args.texts),
           "SHMSERVE_BENCH_API": args.api, "SHMSERVE_BENCH_CORPUS": str(args.corpus)}
    cmd = [sys.executable, "-m", "locust", "-f", str(REPO / "scripts" / "locustfile.py"),
           "--headless", "-u", str(args.users), "-r", str(args.users),
           "-t", f"{int(args.window)}s", "-H", args.url, "--csv", str(prefix),
           "--reset-stats", "--only-summary", "--loglevel", "WARNING", "--stop-timeout", "5"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=args.window + 60)
    stats = Path(f"{prefix}_stats.csv")
    if proc.returncode not in (0, 1) or not stats.exists():
        raise SystemExit(f"locust failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with stats.open() as f:
        agg = next(r for r in csv.DictReader(f) if r["Name"] == "Aggregated")
    requests, failures = int(agg["Request Count"]), int(agg["Failure Count"])
    if requests == 0:
        raise SystemExit("locust sent no request")
    rps = float(agg["Requests/s"])
    ok_share = (requests - failures) / requests
    return {"requests": requests, "failures": failures,
            "texts_per_s": rps * ok_share * args.texts,
            "p50_ms": float(agg["50%"]), "p99_ms": float(agg["99%"])}


class InProcess:
    """The model alone, fed exactly as the worker would batch the same texts."""

    def __init__(self, cfg, corpus: list[str], users: int, texts: int) -> None:
        import torch

        from frontend.tokenizer import TextEncoder
        from gpu_workers.model import EmbeddingModel

        torch.set_num_threads(cfg.workers.torch_threads)
        spec = inspect(cfg.models[0], with_revision=False)
        self.model = EmbeddingModel(spec, torch.device("cpu"))
        enc = TextEncoder(spec, truncate=True).encode(corpus)
        self.texts = [Text(int(b - a), enc.ids[a:b]) for a, b in
                      zip(enc.offsets[:-1], enc.offsets[1:])]
        self.chunk = users * texts
        self.limits = Limits(cfg.batching.max_batch_size, cfg.batching.max_batch_tokens,
                             cfg.batching.max_wait_ms / 1000, cfg.batching.max_pad_ratio)
        self.cursor = 0

    def window(self, seconds: float) -> dict:
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            chunk = [self.texts[(self.cursor + i) % len(self.texts)] for i in range(self.chunk)]
            self.cursor += self.chunk
            queue = chunk
            while queue:
                batch, queue = form_batch(queue, self.limits)
                ids = np.zeros((len(batch.texts), batch.padded_len), np.int64)
                for j, t in enumerate(batch.texts):
                    ids[j, :t.length] = t.ids
                self.model.forward(ids, np.array([t.length for t in batch.texts]))
            done += len(chunk)
        return {"texts_per_s": done / (time.perf_counter() - started)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--env", default=None, help="config env of the running server")
    parser.add_argument("--config", default=None, help="extra config file of the server")
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--texts", type=int, default=1, help="texts per request")
    parser.add_argument("--api", choices=("openai", "msgpack"), default="openai")
    parser.add_argument("--window", type=int, default=20, help="seconds per window")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--out", type=Path, default=REPO / "bench-results")
    args = parser.parse_args()

    cfg = config_mod.load(env=args.env, extra=args.config)
    corpus = json.loads(args.corpus.read_text())
    inproc = InProcess(cfg, corpus, args.users, args.texts)
    inproc.window(2)  # warm-up, as the worker warms up before it reports ready
    args.out.mkdir(parents=True, exist_ok=True)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            served = served_window(args, Path(tmp), f"round{r}")
            ceiling = inproc.window(args.window)
            ratio = served["texts_per_s"] / ceiling["texts_per_s"]
            rounds.append({"served": served, "in_process": ceiling, "ratio": ratio})
            print(f"round {r + 1}/{args.rounds}: served {served['texts_per_s']:.1f} texts/s "
                  f"(p50 {served['p50_ms']:.0f} ms, p99 {served['p99_ms']:.0f} ms, "
                  f"{served['failures']} failed), in-process {ceiling['texts_per_s']:.1f} "
                  f"texts/s, ratio {ratio:.3f}", flush=True)
    ratios = [r["ratio"] for r in rounds]
    summary = {
        "machine": f"{os.cpu_count()} cores, {sys.platform}",
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "users": args.users, "texts_per_request": args.texts, "api": args.api,
        "batching": {"max_batch_size": cfg.batching.max_batch_size,
                     "max_batch_tokens": cfg.batching.max_batch_tokens,
                     "max_wait_ms": cfg.batching.max_wait_ms,
                     "max_pad_ratio": cfg.batching.max_pad_ratio},
        "torch_threads": cfg.workers.torch_threads, "frontends": cfg.frontends.count,
        "median_ratio": statistics.median(ratios), "min_ratio": min(ratios),
        "max_ratio": max(ratios), "rounds": rounds,
    }
    path = args.out / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(summary, indent=2))
    med = lambda key, sub: statistics.median(r[sub][key] for r in rounds)  # noqa: E731
    print()
    print("| profile | served texts/s | p50 ms | p99 ms | in-process texts/s | "
          "served / in-process (median, range) |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.users} users x {args.texts} text(s), {args.api} | "
          f"{med('texts_per_s', 'served'):.1f} | {med('p50_ms', 'served'):.0f} | "
          f"{med('p99_ms', 'served'):.0f} | {med('texts_per_s', 'in_process'):.1f} | "
          f"{summary['median_ratio']:.2f} ({summary['min_ratio']:.2f}-"
          f"{summary['max_ratio']:.2f}) |")
    print(f"\nwritten to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
