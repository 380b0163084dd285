"""What scripts/bench.py writes: the markdown table of a run's summary, the latency plot of its
open-loop sweep, results.json and results.md after each stage, and a stage's error recorded in
the report rather than ending the run."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from benchkit import SCENARIOS


def by_throughput(points: list[dict]) -> list[dict]:
    """The sweep's points in the plot's order: in the sweep's, a point that achieved less than
    the one before drew the lines back on themselves (an outside check)."""
    return sorted(points, key=lambda p: p["requests_per_s"])


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    points = by_throughput(points)  # each point names its share of saturation
    x = [p["requests_per_s"] for p in points]
    ax.plot(x, [p["p50_ms"] for p in points], "o-", label="p50")
    ax.plot(x, [p["p99_ms"] for p in points], "s-", label="p99")
    for p in points:
        ax.annotate(f"{p['fraction']:.0%}", (p["requests_per_s"], p["p99_ms"]),
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xlabel("throughput (requests/s, 1 text each)")
    ax.set_ylabel("latency (ms)")
    ax.set_title("shmserve: open-loop latency against throughput")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _compared(summary: dict) -> str:
    """The comparison's column name: the baseline this script starts, or another URL's."""
    return summary.get("compared", "other")


def markdown(summary: dict) -> str:
    # The comparison's columns only in a run with one (they were all "-" without: an outside
    # check); the failed column counts the requests, so a ratio resting on few shows it.
    compared = any("other_texts_per_s" in s for s in summary["closed_loop"].values())
    other = _compared(summary)
    lines = [f"Machine: {summary['machine']}. Run: {summary['when']}, `{summary['command']}`.",
             f"Config: {summary['setup']}.", "",
             "| scenario | served texts/s | p50 ms | p99 ms | failed requests | in-process "
             "texts/s | served / in-process |"
             + (f" {other} texts/s | {other} failed | served / {other} |" * compared),
             "|---|---|---|---|---|---|---|" + "---|---|---|" * compared]

    def ranged(r: dict | None) -> str:
        return f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})" if r else "-"

    def failures(s: dict, side: str) -> str:
        n, of = s.get(f"{side}_failures", 0), s.get(f"{side}_requests", 0)
        return f"{n} of {of}" + (f" ({n / of:.0%})" if n else "")

    any_failed = False
    for name, s in summary["closed_loop"].items():
        any_failed = any_failed or bool(s.get("served_failures") or s.get("other_failures"))
        lines.append(
            f"| {name} ({SCENARIOS[name].users} users x {SCENARIOS[name].texts}) | "
            f"{s['served_texts_per_s']:.1f} | {s['served_p50_ms']:.0f} | "
            f"{s['served_p99_ms']:.0f} | {failures(s, 'served')} | "
            f"{s['in_process_texts_per_s']:.1f} | {ranged(s['served_vs_in_process'])} |"
            + ("" if not compared else
               f" {s['other_texts_per_s']:.1f} | {failures(s, 'other')} | "
               f"{ranged(s.get('served_vs_other'))} |" if "other_texts_per_s" in s else
               " - | - | - |"))
    if any_failed:
        lines += ["", "Some requests failed: texts/s counts the answers of 200 only; p50 and "
                      "p99 are locust's over every request, the failed ones included."]
    if summary.get("sweep"):
        # both over the window (answered: over the time to the last answer where longer);
        # answered over that time alone exceeded sent (an outside check)
        lines += ["", "| open loop (1 text) | saturation req/s | offered req/s | sent req/s, "
                  "over the window | answered req/s, over the window or to the last answer | "
                  "p50 ms | p99 ms | p99 / p50 | failed requests |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for p in summary["sweep"]:
            sent = p.get("sent_per_s")
            lines.append(f"| {p['fraction']:.0%} of saturation | {p['saturation_rps']:.0f} | "
                         f"{p['offered_rps']:.0f} | "
                         + ("-" if sent is None else f"{sent:.1f}") + " | "
                         f"{p['requests_per_s']:.1f} | {p['p50_ms']:.0f} | {p['p99_ms']:.0f} | "
                         f"{p['p99_ms'] / max(p['p50_ms'], 1e-9):.2f} | "
                         f"{p['failures']} of {p['requests']} |")
    if null := summary.get("null"):
        # its failures and settings shown (an outside check: a null stack answering 429s read
        # as a lower capacity alone)
        how = f" ({null['api']}, {null['users']} users)" if "api" in null else ""
        failures = null.get("failures", 0)
        lines += ["", f"Pipeline capacity, null model, 1 text per request{how}: "
                      f"{null['requests_per_s']:.0f} requests/s answered"
                      + (f"; {failures} of {null['requests']} requests failed" if failures
                         else "")
                      + "."]
    if summary.get("parity"):
        lines.append("")  # a line right after a table's last row renders as one more row
    for key, value in summary.get("parity", {}).items():
        key = _compared(summary) if key == "other" else key  # the table's name for it
        lines.append(f"- Parity, {key}: minimum cosine to sentence-transformers fp32 "
                     f"{value:.6f}.")
    for stage, error in summary.get("errors", {}).items():
        lines += ["", f"The {stage} did not complete: {error}"]
    if summary.get("note"):
        lines += ["", summary["note"]]
    if summary.get("unfinished"):
        lines += ["", f"Unfinished: {summary['unfinished']}."]
    return "\n".join(lines) + "\n"


def save(summary: dict, out: Path, *, unfinished: bool) -> None:
    """Write results.json and results.md as they stand: after each stage that took minutes
    (an interrupted run kept only the sweep's plot: an outside check), marked unfinished until
    the last."""
    if unfinished:
        summary["unfinished"] = ("written before the run's end (its later stages are missing "
                                 "if it was stopped)")
    else:
        summary.pop("unfinished", None)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    (out / "results.md").write_text(markdown(summary))
    if unfinished:
        print(f"bench: the report so far: {out / 'results.md'}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def stage(summary: dict, name: str):
    """A stage after the closed-loop windows: an error is recorded in the summary
    (`errors`), said on stderr, and the run goes on to write its report."""
    try:
        yield
    # SystemExit too: a stage's one-line error (locust failed; no free port left for the null
    # model's stack) is the stage's, and the windows' figures are still written
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported, and the report written
        summary.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
        print(f"bench: the {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
