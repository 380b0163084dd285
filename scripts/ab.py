#!/usr/bin/env python3
"""A/B two configurations of shmserve side by side, the way this machine allows.

Both stacks run at once (an idle stack costs almost nothing); locust windows alternate between
them in ABBA order, so a drift in the machine's speed falls on both alike, and the figure quoted
is the median of the per-round ratios B / A, with their range. Each side is a YAML overlay, given
inline or as a file, deep-merged over the config the way `--config` is:

  .venv/bin/python scripts/ab.py --a 'logging: {flush_interval_ms: 0}' --b '{}' --scenario null
  .venv/bin/python scripts/ab.py --a '{}' --b 'workers: {torch_threads: 1}' --rounds 6

Or A/B two revisions of the code with one overlay: `--a-rev REV` runs side A from a git worktree
of REV (made under a temporary directory, removed after), e.g. this change against main:

  .venv/bin/python scripts/ab.py --a-rev main --a '{}' --b '{}' --scenario null

Scenarios: short (32 users x 1 text, JSON), bulk (4 x 32), mixed (16 x 1..16), null (64 users
x 1 text, msgpack, the built-in null model: the serving pipeline alone); `--users` and `--texts`
change a scenario's clients and texts per request (a GPU-like deep queue: --scenario null
--users 128 --texts 32, with GPU-sized batching in both overlays).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from benchkit import (CORPUS, MIN_WINDOW_S, NULL_SCENARIO, NULL_STACK,  # noqa: E402
                      SCENARIOS, corpus_file, failed, locust_window, open_loop_window,
                      positive, rate)
from benchstacks import (OwnStack, check_ports, checkout, config_problem,  # noqa: E402
                         refuse, require, revision, stop_on_term, run_main)

from shmserve.layers import deep_merge  # noqa: E402

SCENARIOS = {**SCENARIOS, "null": NULL_SCENARIO}


def overlay(text: str) -> dict:
    """An overlay, a YAML file or inline YAML; ArgumentTypeError: what is wrong with it."""
    path = Path(text)
    if not path.is_file() and text.endswith((".yaml", ".yml")):  # said "not a YAML mapping"
        raise argparse.ArgumentTypeError(f"{text}: no such file (an overlay is a YAML file or "
                                         "inline YAML)")
    try:
        tree = yaml.safe_load(path.read_text() if path.is_file() else text)
    except (OSError, yaml.YAMLError) as exc:  # a traceback (an outside check)
        raise argparse.ArgumentTypeError(f"{text!r}: not YAML: {' '.join(str(exc).split())}"
                                         ) from None
    if not isinstance(tree, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: not a YAML mapping")
    return tree


def sides(parser: argparse.ArgumentParser, args, base: dict) -> tuple[dict, dict]:
    """Sides A's and B's configs (`base` under --a's and --b's overlays), refused with the
    overlay named as given, before any stack starts (shared with scripts/burst.py). A side run
    from a revision is checked by that revision's `shmserve up`."""
    trees = {}
    for side in ("a", "b"):
        text = getattr(args, side)
        try:
            trees[side] = deep_merge(base, overlay(text))
        except argparse.ArgumentTypeError as exc:
            parser.error(f"--{side}: {exc}")
        if getattr(args, f"{side}_rev") is None and (
                why := config_problem(args.env, trees[side], f"--{side} {text!r}")):
            refuse(why)
    check_ports(2)  # both stacks run at once
    return trees["a"], trees["b"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="overlay of side A (YAML or a file)")
    parser.add_argument("--b", required=True, help="overlay of side B (YAML or a file)")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="short")
    parser.add_argument("--users", type=positive, help="the scenario's users (clients), changed")
    parser.add_argument("--texts", type=lambda t: t if t == "mixed" else str(positive(t)),
                        help="the scenario's texts per request, changed (or mixed)")
    parser.add_argument("--rounds", type=positive, default=4,
                        help="rounds of 2 windows (A B, then B A: ABBA over two rounds)")
    parser.add_argument("--window", type=positive, default=10,
                        help=f"seconds per window (default 10; closed loop: {MIN_WINDOW_S} "
                             "or more)")
    parser.add_argument("--rate", type=rate, default=0.0,
                        help="open loop instead: Poisson arrivals at this many requests/s of "
                             "one text each (the figure is then p99 / p50 and its ratio)")
    parser.add_argument("--env", help="config env (as SHMSERVE_ENV)")
    parser.add_argument("--a-rev", type=revision,
                        help="run side A's code from this git revision (a worktree)")
    parser.add_argument("--b-rev", type=revision,
                        help="run side B's code from this git revision")
    parser.add_argument("--corpus", type=corpus_file, default=str(CORPUS),
                        help="JSON list of texts (default the shared corpus)")
    args = parser.parse_args()
    if not args.rate and args.window < MIN_WINDOW_S:
        parser.error(f"argument --window: {args.window}: a closed-loop window takes "
                     f"{MIN_WINDOW_S} s or more (locust spawns the users in the first second, "
                     "not counted)")
    stop_on_term()
    require("locust")

    scenario = SCENARIOS[args.scenario]
    scenario = dataclasses.replace(scenario, users=args.users or scenario.users,
                                   texts=args.texts or scenario.texts)
    # the sides' overlays go over the null model's stack
    tree_a, tree_b = sides(parser, args, NULL_STACK if args.scenario == "null" else {})
    metric = "requests_per_s" if args.scenario == "null" else "texts_per_s"
    with checkout(args.a_rev) as repo_a, checkout(args.b_rev) as repo_b, \
            OwnStack(args.env, None, tree_a, repo_a, label=f"side A, --a {args.a!r}") as a, \
            OwnStack(args.env, None, tree_b, repo_b, label=f"side B, --b {args.b!r}") as b:
        for stack in (a, b):  # warm both: first requests load lazily initialised paths
            locust_window(stack.url, scenario, MIN_WINDOW_S, args.corpus)
        ratios = []
        for r in range(args.rounds):
            order = (a, b) if r % 2 == 0 else (b, a)
            got = {id(s): open_loop_window(s.url, args.rate, args.window, args.corpus)
                   if args.rate else locust_window(s.url, scenario, args.window, args.corpus)
                   for s in order}
            ra, rb = got[id(a)], got[id(b)]
            # Open loop: both sides get the offered rate, so the figure is the tail, p99/p50.
            value = (lambda w: w["p99_ms"] / w["p50_ms"]) if args.rate else \
                (lambda w: w[metric])
            # a side that answered nothing 200 has no figure: no ratio for the round (it ended
            # the run in a ZeroDivisionError: an outside check)
            ratio = value(rb) / value(ra) if value(ra) > 0 else float("nan")
            if ratio == ratio:
                ratios.append(ratio)
            side = (lambda w: f"p50 {w['p50_ms']:.0f} ms, p99 {w['p99_ms']:.0f} ms, p99/p50 "
                              f"{value(w):.2f}{failed(w)}") if args.rate else \
                (lambda w: f"{w[metric]:.1f} {metric}, p50 {w['p50_ms']:.0f} ms, "
                           f"p99 {w['p99_ms']:.0f} ms{failed(w)}")
            print(f"round {r + 1}: A {side(ra)} | B {side(rb)} | B/A {ratio:.3f}",
                  flush=True)
    # Open loop: one text a request at the rate, whatever the scenario; a B/A under 1 is a
    # narrower tail on B (not a faster B: compare the p50s and p99s above).
    what, name = ("p99/p50 (under 1: B's tail narrower)", f"open loop at {args.rate:g} req/s") \
        if args.rate else (metric, args.scenario)
    if not ratios:
        print(f"\n{name}: no round had a figure on both sides (see the failures above)")
        return 1
    print(f"\n{name}: B / A {what} median {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} of {args.rounds} "
          "rounds)")
    return 0


if __name__ == "__main__":
    run_main(main)
