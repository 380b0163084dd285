#!/usr/bin/env python3
"""What the packed pass gains, in-process: the same texts through the same batch policy, once
with several length groups in one pass (gpu_workers.packed) and once with the network's own
forward group by group, in alternating windows, each side in a process of its own; the figure
is the median of the per-round ratios packed / per-group, with their range. `--compare
rounding`: the network's own forward with its groups padded to a few shapes (what a CPU worker
runs for a model that does not pack) against it unpadded, with each side's peak memory.
`--compare prepack`: the packed pass with its bf16 linear layers prepacked for oneDNN
(gpu_workers.prepack, the default on a CPU) against `F.linear`; `--compare prepack-grouped`:
the same for the network's own forward group by group (models that do not pack).

  .venv/bin/python scripts/packed_ab.py                         # the config's first model
  .venv/bin/python scripts/packed_ab.py --task classification   # a sequence classifier
  .venv/bin/python scripts/packed_ab.py --device cuda --rounds 6
  .venv/bin/python scripts/packed_ab.py --compare rounding --rounds 12 --window 4
  .venv/bin/python scripts/packed_ab.py --compare prepack --chunk 6

--task classification (or rerank) measures a sequence classifier of the default model's
shape: all-MiniLM-L6-v2's encoder under a randomly initialised head (2 labels, or 1 for
rerank), saved to a temporary directory. Speed does not depend on the head's weights; no
trained classifier of that shape ships offline.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from benchkit import CORPUS, InProcess, corpus_file, positive, seconds  # noqa: E402


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


def child(args) -> None:
    """One side, in a process of its own (oneDNN's kernel cache is per process): windows on
    request (stdin: cursor seconds chunk), texts/s on stdout."""
    import dataclasses

    import torch

    from shmserve import config as config_mod

    cfg = config_mod.load()
    model = None
    if args.model_dir:
        model = dataclasses.replace(cfg.models[0], source=args.model_dir, task=args.task)
    side = InProcess.from_config(cfg, json.loads(args.corpus.read_text()), model=model,
                                 device=args.device, pack=args.child.startswith("packed"),
                                 bucket=False if args.child.endswith("exact") else None,
                                 prepacked=not args.child.endswith("plain"))
    spec = side.model.spec
    if args.child.startswith("packed") and not side.model.packs:
        raise SystemExit(f"{spec.name}: this network does not run the packed pass")
    print(json.dumps({"model": spec.name, "task": spec.task, "dtype": spec.dtype,
                      "threads": torch.get_num_threads(),
                      "prepacked": side.model.prepacked}), flush=True)
    for line in sys.stdin:
        cursor, seconds, chunk = line.split()
        side.cursor = int(cursor)
        result = side.window(float(seconds), int(chunk))
        result["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("config", "classification", "rerank"),
                        default="config")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chunk", type=positive, default=16,
                        help="texts the batch policy sees at a time (a worker's share)")
    parser.add_argument("--rounds", type=positive, default=6)
    parser.add_argument("--window", type=seconds, default=3.0, help="seconds per window")
    parser.add_argument("--corpus", type=corpus_file, default=str(CORPUS))
    parser.add_argument("--compare", choices=("packed", "rounding", "packed-rounding",
                                              "prepack", "prepack-grouped"),
                        default="packed",
                        help="packed: the packed pass against the network's own forward group"
                             " by group; rounding: that own forward with its groups padded to a"
                             " few shapes against it unpadded; packed-rounding: the packed pass"
                             " with its token count rounded against it exact; prepack(-grouped):"
                             " bf16 linears prepacked for oneDNN against F.linear")
    parser.add_argument("--child", choices=("packed", "grouped", "exact", "packed-exact",
                                            "packed-plain", "grouped-plain"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device != "cpu" and not args.child:
        import torch

        try:
            torch.empty(1, device=args.device)
        except (RuntimeError, AssertionError) as exc:  # (a 69-line traceback: an outside check)
            parser.error(f"--device {args.device}: {str(exc).splitlines()[0]}")
    if args.child:  # Ctrl-C, sent to the process group, ends it silently (unless ignored)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        child(args)
        return 0

    from shmserve import config as config_mod
    from shmserve.models import resolve_source

    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, str(Path(__file__).resolve()), "--device", args.device,
                "--corpus", str(args.corpus), "--task", args.task]
        if args.task != "config":
            source = resolve_source(config_mod.load().models[0].source)
            directory = classifier_of(source, 1 if args.task == "rerank" else 2,
                                      Path(tmp) / "model")
            argv += ["--model-dir", str(directory)]
        a, b = {"packed": ("packed", "grouped"), "rounding": ("grouped", "exact"),
                "packed-rounding": ("packed", "packed-exact"),
                "prepack": ("packed", "packed-plain"),
                "prepack-grouped": ("grouped", "grouped-plain")}[args.compare]
        label = {"packed": "packed", "grouped": "per group", "exact": "per group unpadded",
                 "packed-exact": "packed unrounded", "packed-plain": "packed, F.linear",
                 "grouped-plain": "per group, F.linear"}
        sides = {name: subprocess.Popen(argv + ["--child", name], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, cwd=REPO)
                 for name in (a, b)}
        def answer(name: str) -> dict:
            """A side's next line; a side that died says why on stderr (read as a
            JSONDecodeError: an outside check), and this one line more."""
            line = sides[name].stdout.readline()
            if not line:
                raise SystemExit(f"packed_ab.py: side {label[name]!r} exited with status "
                                 f"{sides[name].wait()} (its error is above)")
            return json.loads(line)

        try:
            about = {name: answer(name) for name in sides}
            info = about[a]
            print(f"{info['model']} ({info['task']}, {info['dtype']}) on {args.device}, "
                  f"{info['threads']} threads, chunks of {args.chunk} corpus texts, each side "
                  "in its own process; linear layers prepacked: " + ", ".join(
                      f"{label[n]} {about[n]['prepacked']}" for n in (a, b)))

            def window(name: str, cursor: int) -> dict:
                try:
                    sides[name].stdin.write(f"{cursor} {args.window} {args.chunk}\n")
                    sides[name].stdin.flush()
                except BrokenPipeError:  # it died: answer() says so
                    pass
                return answer(name)

            ratios = []
            for i in range(args.rounds):
                order = (a, b) if i % 2 == 0 else (b, a)
                got = {name: window(name, i * 997) for name in order}  # the same texts
                ratios.append(got[a]["texts_per_s"] / got[b]["texts_per_s"])
                print(f"round {i + 1}: " + ", ".join(
                    f"{label[n]} {got[n]['texts_per_s']:.1f} texts/s (peak RSS "
                    f"{got[n]['max_rss_mb']:.0f} MB)" for n in (a, b))
                    + f", ratio {ratios[-1]:.3f}", flush=True)
        finally:
            for proc in sides.values():
                with contextlib.suppress(BrokenPipeError):  # one that died
                    proc.stdin.close()
                proc.wait(60)
    print(f"{label[a]} / {label[b]}: median {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
