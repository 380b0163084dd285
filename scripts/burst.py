#!/usr/bin/env python3
r"""Overload, measured: what a burst of requests with deadlines gets from two configurations.

A production server under more work than it can do before the deadlines should refuse the excess
at once (429) and answer what it admits in time (200); the failure to avoid is admitting
everything and timing it all out (504). Both stacks run at once (an idle stack costs almost
nothing); rounds alternate A, B, B, A, ..., each a warm-up then a burst of `--requests`
simultaneous requests of `--texts` corpus texts (the same texts for both sides in a round), each
with `X-Request-Timeout: --deadline`, through nginx:

  .venv/bin/python scripts/burst.py --a 'batching: {pass_window: 0}' --b '{}' \
      --requests 600 --texts 32 --deadline 30 --rounds 2

With the admission rule off on both sides (what the batcher's window does when the estimate
fails), add it to each overlay:

  .venv/bin/python scripts/burst.py \
      --a '{batching: {pass_window: 0}, workers: {refuse_past_deadline: false}}' \
      --b '{workers: {refuse_past_deadline: false}}' --requests 600 --texts 16-32 --deadline 10

`--cold` restarts the workers before each burst instead of warming them up: the first burst a
fresh worker meets. `--rate R` sends Poisson arrivals at R requests/s for `--seconds` instead
of one burst (a sustainable load should see no 429 and no 504). `--clients N` runs N clients in
a closed loop for `--seconds` instead: each sends a request and, on a 429, sends it again at once
(`--honour-retry-after`: after the Retry-After it was given) until an answer other than 429 or
its deadline; the figure that matters there is goodput, since clients that retry at once make
the server spend its cores on refusals. `--a-rev REV` runs side A's code from a git worktree of
REV, as scripts/ab.py does.

Per side and round it prints the answers by status, the 200s' median and slowest latency, when
the 429s came (median and last), and the texts answered 200 per second of the burst (goodput).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import errno
import json
import random
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from ab import checkout, sides  # noqa: E402
from benchkit import (CORPUS, auth_headers, corpus_file, positive, rate,  # noqa: E402
                      seconds, text_range)
from benchstacks import OwnStack, revision, stop_on_term, run_main  # noqa: E402


def text_counts(spec: str, n: int, rng: random.Random) -> list[int]:
    lo, _, hi = spec.partition("-")
    return [rng.randint(int(lo), int(hi or lo)) for _ in range(n)]


async def fire(url: str, bodies: list[list[str]], deadline: float, arrivals: list[float]) -> dict:
    import aiohttp

    results: list[tuple[int, float, float, int]] = []  # status, latency, end, texts
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=deadline + 60)
    headers = {"X-Request-Timeout": str(deadline), **auth_headers()}
    async with aiohttp.ClientSession(connector=conn, timeout=timeout, headers=headers) as session:
        begin = time.perf_counter()

        async def one(texts: list[str], due: float) -> None:
            delay = begin + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent = time.perf_counter()
            try:
                async with session.post(url + "/v1/embeddings", json={
                        "input": texts, "encoding_format": "float"}) as resp:
                    await resp.read()
                    status = resp.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                # no answer (0): the one outcome a server must never give; -1: this process
                # could not open a socket, no fault of the server's
                status = -1 if out_of_files(exc) else 0
            now = time.perf_counter()
            results.append((status, now - sent, now - begin, len(texts)))

        await asyncio.gather(*(one(b, d) for b, d in zip(bodies, arrivals)))
        elapsed = time.perf_counter() - begin
    statuses = collections.Counter(r[0] for r in results)
    ok = sorted(r[1] for r in results if r[0] == 200)
    refused = sorted(r[2] for r in results if r[0] == 429)
    return {"statuses": dict(sorted(statuses.items())),
            "ok_p50_s": ok[len(ok) // 2] if ok else None, "ok_max_s": ok[-1] if ok else None,
            "p50_429_s": refused[len(refused) // 2] if refused else None,
            "last_429_s": refused[-1] if refused else None,
            "goodput_texts_per_s": sum(r[3] for r in results if r[0] == 200) / elapsed,
            "elapsed_s": elapsed}


async def storm(url: str, bodies: list[list[str]], deadline: float, clients: int,
                seconds: float, honour: bool) -> dict:
    """`clients` clients for `seconds`, each sending the next of `bodies` and sending it again
    on a 429 (at once, or after its Retry-After when `honour`) until it is answered otherwise
    or its deadline passes (counted as given up)."""
    import aiohttp

    tasks: list[tuple[str, float, int]] = []  # outcome, latency, texts
    answers: collections.Counter = collections.Counter()
    headers = {"X-Request-Timeout": str(deadline), **auth_headers()}
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=deadline + 60)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout, headers=headers) as session:
        begin = time.perf_counter()
        end = begin + seconds
        turn = iter(range(10**9))

        async def client() -> None:
            while time.perf_counter() < end:
                texts = bodies[next(turn) % len(bodies)]
                sent = time.perf_counter()
                outcome = "given up"
                while time.perf_counter() < sent + deadline:
                    left = sent + deadline - time.perf_counter()
                    try:
                        async with session.post(
                                url + "/v1/embeddings",
                                json={"input": texts, "encoding_format": "float"},
                                headers={"X-Request-Timeout": f"{max(left, 0.001):.3f}"}) as resp:
                            await resp.read()
                            status, wait = resp.status, resp.headers.get("Retry-After")
                    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                        status, wait = (-1 if out_of_files(exc) else 0), None
                    answers[status] += 1
                    if status != 429:
                        outcome = str(status)
                        break
                    if honour and wait:
                        await asyncio.sleep(min(float(wait), max(0.0, left)))
                tasks.append((outcome, time.perf_counter() - sent, len(texts)))

        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed = time.perf_counter() - begin
    outcomes = collections.Counter(t[0] for t in tasks)
    ok = sorted(t[1] for t in tasks if t[0] == "200")
    return {"outcomes": dict(sorted(outcomes.items())),
            "answers": {str(k): v for k, v in sorted(answers.items())},
            "ok_p50_s": ok[len(ok) // 2] if ok else None, "ok_max_s": ok[-1] if ok else None,
            "goodput_texts_per_s": sum(t[2] for t in tasks if t[0] == "200") / elapsed,
            "elapsed_s": elapsed}


def out_of_files(exc: BaseException) -> bool:
    """Whether `exc` came from this process's open-files limit (EMFILE, ENFILE)."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def client_side(count: int) -> str:
    return (f"; {count} not sent: this process ran out of open files (ulimit -n "
            f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]})" if count else "")


def describe_storm(r: dict) -> str:
    cell = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731  (milliseconds)
    return (f"requests by outcome {r['outcomes']}, answers {r['answers']}, "
            f"200s p50 {cell(r['ok_p50_s'])} ms max {cell(r['ok_max_s'])} ms, "
            f"goodput {r['goodput_texts_per_s']:.1f} texts/s"
            f"{client_side(int(r['answers'].get('-1', 0)))}")


def describe(r: dict) -> str:
    s = r["statuses"]
    cell = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731  (milliseconds)
    # "no answer" (status 0: the one outcome a server must never give) apart from the other
    # statuses, where it was lumped in (an outside check)
    return (f"200/504/429/other/no answer {s.get(200, 0)}/{s.get(504, 0)}/{s.get(429, 0)}/"
            f"{sum(v for k, v in s.items() if k not in (200, 504, 429, 0, -1))}/{s.get(0, 0)}, "
            f"200s p50 {cell(r['ok_p50_s'])} ms max {cell(r['ok_max_s'])} ms, "
            f"429s at p50 {cell(r['p50_429_s'])} ms last {cell(r['last_429_s'])} ms, "
            f"goodput {r['goodput_texts_per_s']:.1f} texts/s{client_side(s.get(-1, 0))}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="overlay of side A (YAML or a file)")
    parser.add_argument("--b", required=True, help="overlay of side B (YAML or a file)")
    parser.add_argument("--a-rev", type=revision,
                        help="run side A's code from this git revision (a worktree)")
    parser.add_argument("--b-rev", type=revision,
                        help="run side B's code from this git revision")
    parser.add_argument("--requests", type=positive, default=600,
                        help="requests in each burst (default 600)")
    parser.add_argument("--texts", type=text_range, default="32",
                        help="texts per request: N or LO-HI")
    parser.add_argument("--deadline", type=seconds, default=30.0, help="X-Request-Timeout, s")
    parser.add_argument("--rate", type=rate, default=0.0,
                        help="Poisson arrivals at this many requests/s instead of one burst")
    parser.add_argument("--seconds", type=seconds, default=30.0,
                        help="with --rate or --clients: how long")
    parser.add_argument("--clients", type=lambda t: 0 if t == "0" else positive(t), default=0,
                        help="this many clients in a closed loop that send a request again on "
                             "a 429, instead of one burst")
    parser.add_argument("--honour-retry-after", action="store_true",
                        help="with --clients: wait for the 429's Retry-After before sending again")
    parser.add_argument("--rounds", type=positive, default=2, help="ABBA rounds (2 bursts each)")
    parser.add_argument("--cold", action="store_true",
                        help="restart the workers before each burst (no warm-up)")
    parser.add_argument("--env", help="config env (as SHMSERVE_ENV)")
    parser.add_argument("--json", type=Path, help="write every round's results here")
    parser.add_argument("--corpus", type=corpus_file, default=str(CORPUS),
                        help="JSON list of texts (default the shared corpus)")
    args = parser.parse_args()
    if args.json is not None and not args.json.parent.is_dir():  # (found after the whole run,
        parser.error(f"--json {args.json}: no directory {args.json.parent}")  # its results lost)
    stop_on_term()

    corpus = json.loads(args.corpus.read_text())
    if len(corpus) < int(args.texts.rpartition("-")[2]):  # each request's texts are distinct
        parser.error(f"--texts {args.texts}: the corpus has {len(corpus)} texts")
    tree_a, tree_b = sides(parser, args, {})
    rounds = []
    with checkout(args.a_rev) as repo_a, checkout(args.b_rev) as repo_b, \
            OwnStack(args.env, None, tree_a, repo_a, label=f"side A, --a {args.a!r}") as a, \
            OwnStack(args.env, None, tree_b, repo_b, label=f"side B, --b {args.b!r}") as b:
        for r in range(args.rounds):
            rng = random.Random(r)
            if args.rate:
                arrivals, due = [], rng.expovariate(args.rate)
                while due < args.seconds:
                    arrivals.append(due)
                    due += rng.expovariate(args.rate)
            else:
                arrivals = [0.0] * args.requests
            bodies = [rng.sample(corpus, n) for n in text_counts(args.texts, len(arrivals), rng)]
            got = {}
            for name, stack in ((("a", a), ("b", b)) if r % 2 == 0 else (("b", b), ("a", a))):
                if args.cold:  # `restart` returns once the new workers are ready
                    stack.cli("restart", "workers")
                else:
                    # Warm-up, then an idle second: the worker's speed estimate and caches are
                    # those of a stack that has served, and the burst meets an empty queue.
                    asyncio.run(fire(stack.url, bodies[:8], args.deadline,
                                     [0.0] * len(bodies[:8])))
                time.sleep(1.0)
                if args.clients:
                    got[name] = asyncio.run(storm(stack.url, bodies, args.deadline, args.clients,
                                                  args.seconds, args.honour_retry_after))
                    print(f"round {r + 1} {name.upper()}: {describe_storm(got[name])}",
                          flush=True)
                    continue
                got[name] = asyncio.run(fire(stack.url, bodies, args.deadline, arrivals))
                print(f"round {r + 1} {name.upper()}: {describe(got[name])}", flush=True)
            rounds.append(got)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json),
                                                               "corpus": str(args.corpus)},
                                         "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    run_main(main)
