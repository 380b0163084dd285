#!/usr/bin/env python3
"""Where the latency tail at half of saturation comes from: the texts' lengths or the serving.

Prints, for one text per request:
  1. the model alone (the config's first model, dtype and threads; no serving, no queue): one
     corpus text at a time, its forward's p50, p99 and p99/p50, overall and by length: the
     spread a server adds its queueing and pipeline to, at zero load;
  2. served through nginx (a stack of the default config on a free port): an open loop of
     Poisson arrivals at half of the saturation measured just before (closed loop, 32 users),
     on the corpus as it is and on the corpus's texts of one length band (--band, in tokens
     with the specials), interleaved round by round; the median p99/p50 of each.

  .venv/bin/python scripts/tail.py                  # 3 rounds, ~3 minutes
  .venv/bin/python scripts/tail.py --rounds 4 --band 18-22 --texts 1500

On a server that adds little tail of its own, the band's ratio is near what queueing alone
gives, and the corpus's is near the model's own spread (docs/performance.md, "The tail at half
of saturation").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from benchkit import (CORPUS, SCENARIOS, InProcess, corpus_file,  # noqa: E402
                      locust_window, open_loop_window, positive)
from benchmachine import cpu_description  # noqa: E402
from benchstacks import (OwnStack, check_ports, refuse, require, stop_on_term,  # noqa: E402
                         run_main)

from shmserve import config as config_mod  # noqa: E402

BANDS = ((0, 16), (16, 32), (32, 64), (64, 128), (128, 100_000))


def model_alone(inproc: InProcess, count: int) -> dict:
    """Each of the first `count` corpus texts through the model alone, twice."""
    times, seen = [], []
    for _ in range(2):
        for text in inproc.texts[:count]:
            ids = np.asarray([text.ids], np.int64)
            started = time.perf_counter()
            inproc.model.forward_groups([(ids, np.array([text.length]), None)])
            times.append((time.perf_counter() - started) * 1000)
            seen.append(text.length)
    ms, tokens = np.array(times), np.array(seen)
    p50, p99 = np.percentile(ms, 50), np.percentile(ms, 99)
    bands = {f"{lo}-{hi - 1 if hi < 100_000 else 'up'}":
             (int(mask.sum()), float(np.median(ms[mask])))
             for lo, hi in BANDS if (mask := (tokens >= lo) & (tokens < hi)).any()}
    return {"forwards": len(ms), "p50_ms": p50, "p99_ms": p99, "ratio": p99 / p50,
            "tokens_p50": float(np.percentile(tokens, 50)),
            "tokens_p99": float(np.percentile(tokens, 99)), "by_tokens": bands}


def length_band(text: str) -> tuple[int, int]:
    """An argparse type: LO-HI, two token counts."""
    lo, _, hi = text.partition("-")
    if not (lo.isdigit() and hi.isdigit() and int(lo) <= int(hi)):
        raise argparse.ArgumentTypeError(f"{text!r}: LO-HI, two token counts, LO <= HI")
    return int(lo), int(hi)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=positive, default=3,
                        help="interleaved rounds, corpus and band (default 3)")
    parser.add_argument("--window", type=positive, default=15,
                        help="seconds per open-loop window (default 15; the saturation before "
                             "each is a closed-loop window of 10 s)")
    parser.add_argument("--band", type=length_band, default=(18, 22),
                        help="the length band LO-HI, in tokens with the specials (default 18-22; "
                             "the corpus's median text is ~20)")
    parser.add_argument("--texts", type=positive, default=1500,
                        help="the first N corpus texts through the model alone, each twice "
                             "(default 1500; the corpus has ~4,700)")
    parser.add_argument("--corpus", type=corpus_file, default=str(CORPUS),
                        help="JSON list of texts (default the shared corpus)")
    args = parser.parse_args()
    stop_on_term()
    require("locust")
    check_ports(1)
    lo, hi = args.band

    cfg = config_mod.load()
    corpus = json.loads(args.corpus.read_text())
    band_name, first = f"{lo}-{hi}", min(args.texts, len(corpus))
    print(f"machine: {cpu_description()}", flush=True)
    inproc = InProcess.from_config(cfg, corpus)
    # before the minutes of the model-alone pass (said only after it: an outside check)
    band = [text for text, t in zip(corpus, inproc.texts) if lo <= t.length <= hi]
    if len(band) < 50:  # a wrong argument: exit 2, as the others (it was 1)
        refuse(f"--band {band_name}: only {len(band)} corpus texts of {band_name} tokens, of "
               f"{len(corpus)}: the band needs 50 or more")
    alone = model_alone(inproc, args.texts)
    print(f"model alone, one text at a time (the first {first} corpus "
          f"texts, {alone['forwards']} forwards; tokens p50 "
          f"{alone['tokens_p50']:.0f}, p99 {alone['tokens_p99']:.0f}): p50 "
          f"{alone['p50_ms']:.2f} ms, p99 {alone['p99_ms']:.2f} ms, p99/p50 "
          f"{alone['ratio']:.2f}", flush=True)
    for label, (n, median) in alone["by_tokens"].items():
        print(f"  {label} tokens: {n} forwards, median {median:.2f} ms")

    ratios: dict[str, list[float]] = {"corpus": [], "band": []}
    with tempfile.TemporaryDirectory() as tmp, OwnStack(None, None, {}) as stack:
        band_file = Path(tmp) / "band.json"
        band_file.write_text(json.dumps(band))
        corpora = {"corpus": args.corpus, "band": band_file}
        for name in corpora:  # warm both: first requests load lazily initialised paths
            locust_window(stack.url, SCENARIOS["short"], 3, corpora[name])
        for rnd in range(args.rounds):
            for name in ("corpus", "band") if rnd % 2 == 0 else ("band", "corpus"):
                saturation = locust_window(stack.url, SCENARIOS["short"], 10,
                                           corpora[name])["requests_per_s"]
                w = open_loop_window(stack.url, saturation / 2, args.window, corpora[name])
                ratios[name].append(w["p99_ms"] / w["p50_ms"])
                print(f"round {rnd + 1} {name}: saturation {saturation:.0f} req/s, offered "
                      f"{saturation / 2:.0f}, achieved {w['requests_per_s']:.0f}, p50 "
                      f"{w['p50_ms']:.1f} ms, p99 {w['p99_ms']:.1f} ms, p99/p50 "
                      f"{ratios[name][-1]:.2f}, failures {w['failures']}", flush=True)
    rounds = f"{args.rounds} round{'s' if args.rounds > 1 else ''}"
    print(f"\nserved at half of saturation, p99/p50 (median of {rounds}): corpus "
          f"{statistics.median(ratios['corpus']):.2f} ({min(ratios['corpus']):.2f}-"
          f"{max(ratios['corpus']):.2f}); texts of {band_name} tokens ({len(band)}) "
          f"{statistics.median(ratios['band']):.2f} ({min(ratios['band']):.2f}-"
          f"{max(ratios['band']):.2f}); the model alone on the first {first} "
          f"corpus texts {alone['ratio']:.2f}")


if __name__ == "__main__":
    run_main(main)
