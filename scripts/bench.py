#!/usr/bin/env python3
"""shmserve's benchmark suite: locust scenarios over the shared corpus of real sentences.

Closed-loop scenarios (interleaved in rounds, because this machine's speed drifts):
  short   32 users x 1 text per request
  bulk     4 users x 32 texts per request
  mixed   16 users x 1..16 texts per request (mixed lengths come from the corpus)
Each round runs, back to back: the served window; the in-process ceiling (the model alone, same
dtype, threads and batch policy, on the same texts grouped the way the server sees them:
consecutive chunks of users x texts); and, with --compare, the other server's window. Figures
quoted are medians over rounds of the per-round ratios, with their range.

Then: an open-loop sweep at 25/50/75/100% of the short scenario's saturation, measured by a
closed-loop window just before each point (Poisson arrivals
from an asyncio generator, since locust's users are a closed loop; latency against throughput,
plotted), the pipeline capacity with the built-in `null` model (zeros, no compute:
nginx, frontends, shared memory, ZeroMQ and batching alone), and vector parity against
sentence-transformers fp32.

  .venv/bin/python scripts/bench.py                      # starts and stops its own stacks
  .venv/bin/python scripts/bench.py --compare baseline   # also the FastAPI baseline it starts
  .venv/bin/python scripts/bench.py --compare http://host:port   # any OpenAI-compatible URL
  .venv/bin/python scripts/bench.py --url http://127.0.0.1:8080 --only short   # a running stack
Writes bench-results/<time>/{results.json, results.md, and latency.png with the sweep}: the
report after each stage (the closed-loop windows, parity, the sweep, the null pipeline), so a
run stopped part way keeps the stages it finished (not the rounds of one it was in).
A server with auth.api_keys set: SHMSERVE_API_KEY=<key> (sent as a bearer token with every
request the bench makes, to --compare's URL too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from benchkit import (CORPUS, NULL_STACK, SCENARIOS, Scenario, auth_headers,  # noqa: E402
                      ceiling, closed_window, corpus_file, failed, locust_window,
                      open_loop_window, positive, probe)
from benchmachine import cpu_description, gpu_description  # noqa: E402
from benchparity import min_cosine_to_fp32, other_model, parity_reference  # noqa: E402
from benchreport import markdown, plot, save, stage  # noqa: E402
from benchstacks import (Baseline, OwnStack, check_ports, refuse, require,  # noqa: E402
                         run_main, stop_on_term)

from shmserve import config as config_mod  # noqa: E402
from shmserve import topology  # noqa: E402
from shmserve.cores import usable_cores  # noqa: E402

def closed_loop(args, url: str, other: str | None, inproc) -> dict:
    results = {}
    for name in args.only:
        scenario = SCENARIOS[name]
        rounds = []
        for r in range(args.rounds):
            row = {"served": locust_window(url, scenario, args.window, args.corpus)}
            chunk = int(scenario.users * scenario.texts_mean)
            row["in_process"] = inproc.window(args.window, chunk)
            if other:
                row["other"] = locust_window(other, scenario, args.window, args.corpus)
            rounds.append(row)
            print(f"{name} round {r + 1}: " + ", ".join(
                f"{k} {v['texts_per_s']:.1f} texts/s{failed(v)}" for k, v in row.items()),
                flush=True)
        results[name] = summarize(rounds)
    return results


def summarize(rounds: list[dict]) -> dict:
    def ratio(a: str, b: str) -> dict | None:
        """Over the rounds where `b` answered anything (None: in none)."""
        values = [r[a]["texts_per_s"] / r[b]["texts_per_s"] for r in rounds
                  if r[b]["texts_per_s"] > 0]
        return {"median": statistics.median(values), "min": min(values),
                "max": max(values)} if values else None

    out = {"rounds": rounds, "served_vs_in_process": ratio("served", "in_process")}
    if "other" in rounds[0]:
        out["served_vs_other"] = ratio("served", "other")
    for key in ("texts_per_s", "requests_per_s", "p50_ms", "p99_ms"):
        out[f"served_{key}"] = statistics.median(r["served"][key] for r in rounds)
    out["in_process_texts_per_s"] = statistics.median(r["in_process"]["texts_per_s"]
                                                      for r in rounds)
    for side in ("served", "other"):  # every round's requests that were not answered 200
        if side in rounds[0]:
            out[f"{side}_failures"] = sum(r[side]["failures"] for r in rounds)
            out[f"{side}_requests"] = sum(r[side]["requests"] for r in rounds)
    if "other" in rounds[0]:
        out["other_texts_per_s"] = statistics.median(r["other"]["texts_per_s"] for r in rounds)
    return out


def sweep(args, url: str) -> list[dict]:
    """Each point's rate is a fraction of the short scenario's saturation measured just before
    it (a closed-loop window), not minutes earlier: the machine's speed drifts in between."""
    points = []
    for fraction in (0.25, 0.5, 0.75, 1.0):
        closed = locust_window(url, SCENARIOS["short"], args.window, args.corpus)
        saturation = closed["requests_per_s"]
        rate = max(1.0, saturation * fraction)
        window = open_loop_window(url, rate, args.window, args.corpus)
        points.append({"fraction": fraction, "saturation_rps": saturation, "offered_rps": rate,
                       "saturation_measured_s": closed["measured_s"], **window})
        print(f"open loop {fraction:.0%} of {saturation:.0f} ({rate:.0f} req/s offered, "
              f"{window['sent_per_s']:.1f} sent): "
              f"{window['requests_per_s']:.1f} req/s answered, p50 {window['p50_ms']:.0f} ms, "
              f"p99 {window['p99_ms']:.0f} ms{failed(window)}", flush=True)
    return points


def saturations_disagree(points: list[dict], most: float = 1.5) -> str | None:
    """What to say when the saturations a sweep measured before its points differ by more than
    `most` times: its rates are fractions of different speeds, and the curve doubles back (an
    outside check's run on a loaded machine: 189, 80, 55 and 115 requests/s, so its "75%"
    offered less than its "25%")."""
    rates = [p["saturation_rps"] for p in points]
    if not rates or min(rates) <= 0 or max(rates) / min(rates) <= most:
        return None
    return (f"the open-loop sweep's saturations differ {max(rates) / min(rates):.1f}x "
            f"({', '.join(f'{r:.0f}' for r in rates)} requests/s): the machine's speed moved "
            "during it, so its points are not fractions of one saturation; run it again")


def null_capacity(args) -> dict:
    with OwnStack(args.env, args.config, NULL_STACK) as stack:
        windows = [locust_window(stack.url, Scenario("null", args.null_users, "1",
                                                     api=args.null_api),
                                 args.window, args.corpus) for _ in range(args.rounds)]
    rps = statistics.median(w["requests_per_s"] for w in windows)
    requests, failures = (sum(w[k] for w in windows) for k in ("requests", "failures"))
    print(f"null pipeline: {rps:.0f} requests/s answered"
          + (f", {failures} of {requests} requests failed" if failures else ""), flush=True)
    return {"requests_per_s": rps, "api": args.null_api, "users": args.null_users,
            "requests": requests, "failures": failures, "windows": windows}


def server_url(text: str) -> str:
    """An argparse type: an http(s) URL, its root (an OpenAI client's base URL, ending in /v1,
    names the same server; --url took neither that nor a URL without its scheme: a traceback,
    an outside check)."""
    parsed = urllib.parse.urlsplit(text)
    if not (parsed.scheme in ("http", "https") and parsed.netloc):
        raise argparse.ArgumentTypeError(f"{text!r}: an http(s)://HOST:PORT URL")
    return text.rstrip("/").removesuffix("/v1")


def compared(text: str) -> str:
    """An argparse type: 'baseline', or an http(s) URL (found out only at the end, as a
    ZeroDivisionError, after every window had run), as server_url takes it."""
    if text == "baseline":
        return text
    try:
        return server_url(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: 'baseline' or an http(s)://HOST:PORT URL") from None


def named_model(models: list[dict], name: str | None, where: str) -> dict:
    """The model the run measures, of `models` (GET /info's, or the config's as {name,
    aliases}): the one `--model` names (by name or alias), else the first, which requests that
    name none get. It was always the first: a run of a stack's second model reported the
    first, read its ratio against the first's ceiling and failed in parity (an outside
    check)."""
    if not name:
        return models[0]
    for model in models:
        if name == model["name"] or name in model.get("aliases", ()):
            return model
    raise SystemExit(f"--model {name!r}: {where} serves no such model (it serves "
                     f"{', '.join(m['name'] for m in models)})")


def stack_info(url: str, what: str) -> dict:
    """A shmserve stack's GET /info; SystemExit, one line, where `url` answers none (nothing
    there, or not shmserve: a traceback after the ceiling's ~10 s, an outside check)."""
    req = urllib.request.Request(url + "/info", headers=auth_headers())
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            info = json.loads(resp.read())
        if not ({"frontends", "workers", "limits"} <= set(info)
                and {"name", "dtype"} <= set(info["models"][0])):  # what the report reads
            raise KeyError("frontends, workers, limits, models[0].name and .dtype")
        return info
    except urllib.error.HTTPError as exc:
        exc.close()  # (its unread answer held a socket: a ResourceWarning when collected)
        hint = (" (a key: SHMSERVE_API_KEY)" if exc.code == 401 else
                ": not a shmserve stack (--url measures one; any OpenAI-compatible server "
                "goes in --compare)" if exc.code == 404 else "")
        raise SystemExit(f"{what} {url}: GET /info answered {exc.code}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise SystemExit(f"{what} {url}: GET /info failed: "
                         f"{getattr(exc, 'reason', None) or exc}") from None
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise SystemExit(f"{what} {url}: GET /info did not describe a shmserve stack "
                         f"({type(exc).__name__}: {exc})") from None


def scenario_names(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'none'}: the scenarios are "
                                         f"{', '.join(SCENARIOS)}")
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", type=server_url,
                        help="a running shmserve stack to measure (default: start one per the "
                             "config); the in-process ceiling still runs here, and the null "
                             "pipeline is not measured")
    parser.add_argument("--env", help="config env (as SHMSERVE_ENV)")
    parser.add_argument("--config", help="extra config file for the stack and the ceiling")
    parser.add_argument("--compare", type=compared,
                        help="'baseline' (started here) or an OpenAI-compatible URL")
    parser.add_argument("--model", help="the model name every request names (default: none, "
                        "the server's default); --compare's server gets the same name (a "
                        "strict OpenAI-compatible server may need one)")
    parser.add_argument("--only", default="short,bulk,mixed", type=scenario_names,
                        help=f"scenarios, comma-separated, of {', '.join(SCENARIOS)}")
    parser.add_argument("--rounds", type=positive, default=3,
                        help="interleaved rounds per scenario (default 3)")
    parser.add_argument("--window", type=closed_window, default=15,
                        help="seconds per window (default 15; 3 or more: locust spawns the "
                             "users in the first second, which is not counted)")
    parser.add_argument("--no-sweep", action="store_true",
                        help="skip the open-loop sweep at 25-100%% of saturation (and its plot)")
    parser.add_argument("--no-null", action="store_true",
                        help="skip the null-model pipeline capacity (measured on a stack this "
                             "script starts here, serving the null model: skipped with --url)")
    parser.add_argument("--null-users", type=positive, default=64,
                        help="locust users for the null pipeline (default 64)")
    parser.add_argument("--null-api", choices=("openai", "msgpack"), default="msgpack",
                        help="the null pipeline's API (default msgpack)")
    parser.add_argument("--corpus", type=corpus_file, default=str(CORPUS),
                        help="JSON list of texts (default the shared corpus)")
    parser.add_argument("--out", type=Path, default=REPO / "bench-results",
                        help="results go to OUT/<time>/ (default bench-results)")
    args = parser.parse_args()
    if args.model:  # the locustfile, the open loop and parity read it (benchkit)
        os.environ["SHMSERVE_BENCH_MODEL"] = args.model
    stop_on_term()
    require("locust", "sentence_transformers",  # the windows; parity against its fp32
            *(() if args.no_sweep else ("matplotlib",)),
            *(("fastapi", "uvicorn") if args.compare == "baseline" else ()))
    # Said on stderr now and written at the end of the report.
    few_rounds = (f"{args.rounds} round(s): the ranges and medians rest on so few windows that "
                  "the machine's drift can decide them; use 3 or more" if args.rounds < 3
                  else None)
    if few_rounds:
        print(f"bench: {few_rounds}", file=sys.stderr)
    notes = [few_rounds] if few_rounds else []  # said on stderr, and at the report's end
    if args.url and not args.no_null:
        # The null model's capacity needs a stack serving it, which is one this script starts
        # on this machine: beside a report of the stack at --url it would read as that one's.
        print("bench: --url: the null pipeline's capacity is not measured (it needs a stack "
              "serving the null model, started here); run without --url for it",
              file=sys.stderr)
        args.no_null = True

    try:
        cfg = config_mod.load(env=args.env, extra=args.config)
    except config_mod.ConfigError as exc:  # a traceback of 21 lines said it (an outside check)
        refuse(f"config: {exc}")  # exit 2, as every wrong argument (it was 1)
    # Before the ceiling is built and any stack starts: what the run needs, and the servers it
    # is given (found after both, as tracebacks: an outside check)
    check_ports((not args.url) + (args.compare == "baseline") + (not args.no_null))
    try:
        described = stack_info(args.url, "--url's stack") if args.url else None
        if args.url:
            probe(args.url, "--url's stack")
            named_model(described["models"], args.model, f"the stack at {args.url}")
        else:
            named_model([{"name": m.name, "aliases": m.aliases} for m in cfg.models],
                        args.model, "the config")
        if args.compare and args.compare != "baseline":
            probe(args.compare, "--compare's server")
    except SystemExit as exc:  # a wrong argument: exit 2, as argparse's
        parser.error(str(exc))
    corpus = json.loads(args.corpus.read_text())
    out = args.out / time.strftime("%Y%m%d-%H%M%S")  # made once there is something to write
    devices = topology.worker_devices(cfg)
    gpus = sorted({d for d in devices if d != topology.CPU}, key=int)
    workers = (f"{len(devices)} GPU worker(s)" if gpus else
               f"{len(devices)} CPU worker(s) x {cfg.workers.torch_threads} torch threads")
    summary = {"machine": f"{os.cpu_count()} cores, {platform.machine()}, "
                          f"{cpu_description()}, {gpu_description(gpus)}",
               "when": time.strftime("%Y-%m-%d %H:%M"),
               "command": " ".join(["scripts/bench.py", *sys.argv[1:]]),
               "setup": f"{cfg.frontends.count} frontends, {workers}, {cfg.models[0].dtype}, "
                        f"max_batch_size {cfg.batching.max_batch_size}, max_batch_tokens "
                        f"{cfg.batching.max_batch_tokens}, max_wait_ms "
                        f"{cfg.batching.max_wait_ms}, max_pad_ratio "
                        f"{cfg.batching.max_pad_ratio}"}
    inproc = ceiling(cfg, args.corpus, args.env, args.config)
    with contextlib.ExitStack() as stack:
        if hasattr(inproc, "close"):
            stack.callback(inproc.close)
        url = args.url or stack.enter_context(OwnStack(args.env, args.config, {})).url
        other = None
        if args.compare == "baseline":
            other = stack.enter_context(Baseline(usable_cores())).url  # all cores
        elif args.compare:
            other = args.compare
        if args.compare:
            summary["compared"] = "baseline" if args.compare == "baseline" else "other"
        described = described or stack_info(url, "the served stack")
        served = named_model(described["models"], args.model, f"the stack at {url}")
        if args.url:  # measured there, as it runs; the ceiling runs the local config
            limits = described["limits"]
            summary["setup"] = (
                f"the stack at {args.url}: {described['frontends']} frontends, "
                f"{described['workers']} workers, max_batch_size {limits['max_batch_size']}, "
                f"max_batch_tokens {limits['max_batch_tokens']} (GET /info); the in-process "
                f"ceiling runs the local config: {summary['setup']}")
        summary["setup"] += f"; serving {served['name']} in {served['dtype']}"
        if differs := other_model(cfg, served["name"]):
            print(f"bench: {differs}", file=sys.stderr)
            summary["setup"] += f"; NOTE: {differs}"
        reference, unmeasured = None, None
        try:
            reference = parity_reference(cfg, served["name"])
        except ValueError as exc:  # said now, and a note: not the run's failure (exit 1)
            unmeasured = f"parity not measured: {exc} (--config naming it gives one)"
            print(f"bench: {unmeasured}", file=sys.stderr)
            notes.append(unmeasured)
        probe(url, "the served stack")
        if other:
            probe(other, "--compare's server")
        summary["closed_loop"] = closed_loop(args, url, other, inproc)
        save(summary, out, unfinished=True)  # and after each later stage
        # What follows the windows may fail (a server that answers a parity request 503, a
        # sweep's window with no answer): said in the report, which is written still (a
        # failed parity request lost every window's figures: an outside check).
        if not unmeasured:
            with stage(summary, "parity check"):
                summary["parity"] = {"shmserve": min_cosine_to_fp32(url, corpus[:128],
                                                                    reference)}
                if other:
                    summary["parity"]["other"] = min_cosine_to_fp32(other, corpus[:128],
                                                                    reference)
        save(summary, out, unfinished=True)
        if args.no_sweep:
            pass
        elif "short" not in summary["closed_loop"]:
            print("bench: the open-loop sweep needs the short scenario (--only without short): "
                  "skipped", file=sys.stderr)
        else:
            with stage(summary, "open-loop sweep"):
                summary["sweep"] = sweep(args, url)
                if moved := saturations_disagree(summary["sweep"]):
                    print(f"bench: {moved}", file=sys.stderr)
                    notes.append(moved)
                out.mkdir(parents=True, exist_ok=True)
                plot(summary["sweep"], out / "latency.png")
            save(summary, out, unfinished=not args.no_null)
    if not args.no_null:
        with stage(summary, "null pipeline"):
            summary["null"] = null_capacity(args)
    if notes:
        summary["note"] = " ".join(f"{note[0].upper()}{note[1:]}." for note in notes)
    save(summary, out, unfinished=False)
    print("\n" + markdown(summary) + f"\nwritten to {out}")
    return 1 if summary.get("errors") else 0


if __name__ == "__main__":
    run_main(main)
