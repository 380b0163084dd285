#!/usr/bin/env python3
"""Milliseconds per pass of the worker's batch formation (`gpu_workers.batcher.form_pass`) with
its queue held at a given size, as under a GPU worker kept saturated (each pass's texts are
replaced by new arrivals), for this checkout and, interleaved, for another revision.

  .venv/bin/python scripts/batcher_bench.py                    # this checkout
  .venv/bin/python scripts/batcher_bench.py --against HEAD~1   # A/B, median of the ratios

Texts: lengths drawn like short corpus sentences (lognormal, median ~16 tokens, 3-128), one
model, one priority; limits 256 texts and 32,768 padded tokens a pass (a GPU's), and a model
whose groups merge into one pass (BERT's layers).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from benchkit import positive  # noqa: E402
from benchstacks import revision  # noqa: E402


@dataclass(eq=False)
class Text:
    length: int
    model: str = "m"
    priority: int = 0
    arrived: float = 0.0


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def per_pass_ms(batcher, queue_size: int, passes: int, seed: int) -> float:
    rng = random.Random(seed)
    draw = lambda: Text(min(128, max(3, int(rng.lognormvariate(2.8, 0.5)))))  # noqa: E731
    # configs/gpu.yaml's batching; the pass window (8 x max_batch_size) where the side has one
    window = {"window": 8 * 256} if "window" in batcher.Limits.__dataclass_fields__ else {}
    limits = batcher.Limits(256, 32768, 0.005, 1.5, **window)
    queue = [draw() for _ in range(queue_size)]
    spent = 0.0
    for _ in range(passes):
        started = time.perf_counter()
        batches, queue = batcher.form_pass(queue, limits, False, lambda text: True)
        spent += time.perf_counter() - started
        queue += [draw() for _ in range(sum(len(b.texts) for b in batches))]
    return spent / passes * 1000


def sizes(text: str) -> str:
    """An argparse type: queue sizes, a comma list of integers >= 1."""
    for size in text.split(","):
        positive(size)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=sizes, default="64,512,4096", help="queue sizes, in texts")
    parser.add_argument("--passes", type=positive, default=40)
    parser.add_argument("--rounds", type=positive, default=8)
    parser.add_argument("--against", type=revision,
                        help="a git revision to A/B this checkout with")
    args = parser.parse_args()
    sides = {"this": load(REPO / "gpu_workers" / "batcher.py", "batcher_this")}
    with tempfile.TemporaryDirectory() as tmp:
        if args.against:
            shown = subprocess.run(["git", "show", f"{args.against}:gpu_workers/batcher.py"],
                                   cwd=REPO, capture_output=True, text=True)
            if shown.returncode != 0:  # a revision without the file
                parser.error(f"--against {args.against}: {shown.stderr.strip()}")
            source = shown.stdout
            (Path(tmp) / "batcher_other.py").write_text(source)
            sides["other"] = load(Path(tmp) / "batcher_other.py", "batcher_other")
        for size in map(int, args.sizes.split(",")):
            times: dict[str, list[float]] = {name: [] for name in sides}
            for round_ in range(args.rounds):  # interleaved: the machine's drift hits both
                for name, batcher in sides.items():
                    times[name].append(per_pass_ms(batcher, size, args.passes, round_))
            line = f"queue {size:5d} texts: this {statistics.median(times['this']):.3f} ms/pass"
            if args.against:
                ratios = [o / t for o, t in zip(times["other"], times["this"])]
                line += (f", {args.against} {statistics.median(times['other']):.3f}; this is "
                         f"{statistics.median(ratios):.2f}x as fast ({min(ratios):.2f}-"
                         f"{max(ratios):.2f}, {args.rounds} interleaved rounds)")
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
