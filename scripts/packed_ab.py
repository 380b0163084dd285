#!/usr/bin/env python3
"""What the packed pass gains, in-process: the same texts through the same batch policy, once
with several length groups in one pass (gpu_workers.packed) and once with the network's own
forward group by group, in alternating windows; the figure is the median of the per-round
ratios packed / per-group, with their range.

  .venv/bin/python scripts/packed_ab.py                         # the config's first model
  .venv/bin/python scripts/packed_ab.py --task classification   # a sequence classifier
  .venv/bin/python scripts/packed_ab.py --device cuda --rounds 6

--task classification (or rerank) measures a sequence classifier of the default model's
shape: all-MiniLM-L6-v2's encoder under a randomly initialised head (2 labels, or 1 for
rerank), saved to a temporary directory. Speed does not depend on the head's weights; no
trained classifier of that shape ships offline.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from benchkit import CORPUS, InProcess  # noqa: E402


def classifier_of(source: Path, labels: int, into: Path) -> Path:
    """`source`'s encoder under a random sequence-classification head, as a model directory."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(source, num_labels=labels)
    torch.manual_seed(0)
    net = AutoModelForSequenceClassification.from_pretrained(source, config=config)
    net.save_pretrained(into, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.txt"):
        if (source / name).is_file():
            shutil.copy(source / name, into / name)
    return into


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("config", "classification", "rerank"),
                        default="config")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chunk", type=int, default=16,
                        help="texts the batch policy sees at a time (a worker's share)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--window", type=float, default=3.0, help="seconds per window")
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    args = parser.parse_args()

    import dataclasses

    import torch

    from gpu_workers.batcher import Limits
    from shmserve import config as config_mod
    from shmserve.models import inspect, resolve_source

    cfg = config_mod.load()
    if args.device == "cpu":
        torch.set_num_threads(cfg.workers.torch_threads)
    model_cfg = cfg.models[0]
    corpus = json.loads(args.corpus.read_text())
    limits = Limits(cfg.batching.max_batch_size, cfg.batching.max_batch_tokens,
                    cfg.batching.max_wait_ms / 1000, cfg.batching.max_pad_ratio)
    with tempfile.TemporaryDirectory() as tmp:
        if args.task != "config":
            source = resolve_source(model_cfg.source)
            directory = classifier_of(source, 1 if args.task == "rerank" else 2, Path(tmp))
            model_cfg = dataclasses.replace(model_cfg, source=str(directory), task=args.task)
        spec = inspect(model_cfg, with_revision=False, roots=[Path(tmp)])
        device = torch.device(args.device)
        packed = InProcess(spec, device, limits, corpus)
        grouped = InProcess(spec, device, limits, corpus, pack=False)
        if not packed.model.packs:
            raise SystemExit(f"{spec.name}: this network does not run the packed pass")
        print(f"{spec.name} ({spec.task}, {packed.model.spec.dtype}) on {args.device}, "
              f"{torch.get_num_threads()} threads, chunks of {args.chunk} corpus texts")
        ratios = []
        for i in range(args.rounds):
            first, second = (packed, grouped) if i % 2 == 0 else (grouped, packed)
            packed.cursor = grouped.cursor = i * 997  # both sides on the same texts
            first_rate = first.window(args.window, args.chunk)["texts_per_s"]
            second_rate = second.window(args.window, args.chunk)["texts_per_s"]
            rates = {id(first): first_rate, id(second): second_rate}
            p, g = rates[id(packed)], rates[id(grouped)]
            ratios.append(p / g)
            print(f"round {i + 1}: packed {p:.1f} texts/s, per group {g:.1f}, "
                  f"ratio {p / g:.3f}", flush=True)
    print(f"packed / per group: median {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
