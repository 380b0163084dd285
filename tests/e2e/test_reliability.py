"""Reliability through nginx: client disconnects, overload, priority (stopping: test_stopping)."""

import asyncio
import collections
import concurrent.futures
import json
import math
import os
import re
import signal
import socket
import statistics
import threading
import time

import aiohttp
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shmserve.admission import SHARE
from tests.conftest import tiny_overrides
from tests.stack import Stack

LONG = "word " * 600  # truncated to the slow model's 512 tokens: ~25 ms a forward on one thread
# A flood's texts: long enough that a queue of them outlasts a short request many times over,
# short enough that the test's 24 requests through that queue take seconds, not a minute.
MEDIUM = "word " * 120
MEDIUM_TOKENS = 123  # with a number after it and the two special tokens
# Resident memory each process must stay under while flooded (stated in the README).
RSS_LIMITS_MB = {"frontend": 400, "worker": 1200, "nginx": 100}


def slow_stack(root, slow_model, **extra) -> Stack:
    overrides = tiny_overrides(slow_model, **extra)
    overrides["limits"]["truncate"] = True
    return Stack(root, overrides)


def refusal_reasons(stack: Stack, frontends: int) -> collections.Counter:
    """The error_reason of every 429 in the frontends' access lines."""
    return collections.Counter(line.get("error_reason") for i in range(frontends)
                               for line in stack.log_lines(f"frontend-{i}")
                               if line.get("status") == 429)


def inflight(stack: Stack) -> float:
    _, _, raw = stack.get("/metrics")
    return sum(s.value for f in text_string_to_metric_families(raw.decode())
               for s in f.samples if s.name == "shmserve_frontend_inflight_requests")


def arena_used(stack: Stack) -> float:
    """The bytes in use in the frontends' arenas (the gauge, set every second): a request's
    tensors are written there as it is handed to a worker."""
    _, _, raw = stack.get("/metrics")
    return sum(s.value for f in text_string_to_metric_families(raw.decode())
               for s in f.samples if s.name == "shmserve_frontend_arena_used_bytes")


def queued_texts(stack: Stack) -> int:
    status, _, raw = stack.get("/ready")
    return sum(w["queued_texts"] or 0 for w in json.loads(raw)["workers"])


def test_client_disconnect_aborts_queued_work(tmp_path, slow_model):
    # No admission by deadline (workers.refuse_past_deadline): the SIGSTOP below makes one pass
    # take ~1.8 s, and the worker's speed estimate, taken from it and the two or three before
    # (~42 ms), fell to ~900 tokens/s: the request that goes away, read after that pass, could
    # be refused for its deadline (19,000 tokens ahead, ~21 s against 0.75 x 30 s), an answer
    # that no drop line follows. The fresh-clone CI of f80abb1 failed so (a 499 without
    # handoff, no drop line), as two earlier CI runs had.
    stack = slow_stack(tmp_path / "s", slow_model, frontends={"count": 1},
                       batching={"max_batch_size": 1},
                       workers={"heartbeat_timeout_s": 60, "hung_kill_s": 120,
                                "torch_threads": 1, "refuse_past_deadline": False})
    stack.up()
    try:
        results = {}
        busy = threading.Thread(target=lambda: results.update(
            a=stack.post_json("/predict", {"texts": [LONG] * 40})[0]))
        busy.start()  # ~1 s of work queued ahead of the request that will go away
        stack.wait_until(lambda: queued_texts(stack) > 0, 30, "the worker to hold work")
        worker = stack.pid("workers:worker-0")
        # Freeze the worker, so the request below is still queued when its client leaves.
        os.kill(worker, signal.SIGSTOP)
        try:
            # Handed to the worker once its tensors are in the arena: being in flight was not
            # enough (a loaded CI run saw the client leave before the handoff: no drop line).
            # The gauge is set every second: read once it holds the busy request's bytes (a
            # reading from before them let that request's own bytes pass for the handoff below;
            # CI saw it: a 499 without handoff_ms, no drop line).
            stack.wait_until(lambda: arena_used(stack) > 0, 30, "the busy request's arena bytes")
            held = arena_used(stack)
            body = json.dumps({"texts": ["gone"] * 5}).encode()
            client = socket.create_connection(("127.0.0.1", stack.port))
            client.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nX-Request-ID: gone-1\r\n"
                           b"Content-Type: application/json\r\nContent-Length: "
                           + str(len(body)).encode() + b"\r\n\r\n" + body)
            stack.wait_until(lambda: inflight(stack) == 2, 30, "both requests in flight")
            stack.wait_until(lambda: arena_used(stack) > held, 30, "its handoff to the worker")
            client.close()
            stack.wait_until(lambda: inflight(stack) == 1, 30, "the handler to give up")
        finally:
            os.kill(worker, signal.SIGCONT)
        stack.wait_until(lambda: "gone-1" in stack.log("worker-0"), 30, "the worker's drop line")
        stack.wait_until(lambda: "gone-1" in stack.log("frontend-0"), 30, "the access line")
        access = [json.loads(line) for line in stack.log("frontend-0").splitlines()
                  if "gone-1" in line]
        assert [(a["status"], a["error"]) for a in access] == [(499, "client_closed")]
        busy.join(60)
        assert results["a"] == 200
        lines = [json.loads(line) for line in stack.log("worker-0").splitlines()
                 if "gone-1" in line]
        assert [(l["message"], l["reason"]) for l in lines] == [("request.dropped", "aborted")]
    finally:
        stack.down()


def test_a_client_past_its_requests_in_flight_is_refused_by_nginx(tmp_path, slow_model):
    """nginx.max_requests_per_client: one client's 4 requests at once, 2 allowed in flight:
    two served, two refused at once with 429 (its own message, Retry-After 1), counted in
    /metrics as nginx's own answers; the frontends never saw them."""
    stack = slow_stack(tmp_path / "s", slow_model, frontends={"count": 1},
                       nginx={"max_requests_per_client": 2})
    stack.up()
    try:
        start = threading.Barrier(4)
        answers: list = []

        def client(n: int) -> None:
            start.wait()
            answers.append(stack.post_json("/predict", {"texts": [LONG] * 20},
                                           {"X-Request-ID": f"inflight-{n}"}))

        threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert sorted(status for status, _, _ in answers) == [200, 200, 429, 429], \
            [(status, body) for status, _, body in answers]
        for status, headers, body in answers:
            if status == 429:
                assert headers["Retry-After"] in ("1", "2"), headers  # (half say 2)
                assert "nginx.max_requests_per_client" in body["error"]["message"], body
        refused = {headers["X-Request-ID"] for status, headers, _ in answers if status == 429}
        seen = stack.log("frontend-0")
        assert not [rid for rid in refused if rid in seen], refused  # nginx's own answers

        def counted() -> float:
            _, _, raw = stack.get("/metrics")
            return sum(s.value for f in text_string_to_metric_families(raw.decode())
                       for s in f.samples if s.name == "shmserve_nginx_responses_total"
                       and s.labels.get("status") == "429")
        stack.wait_until(lambda: counted() == 2, 10, "nginx's two 429s in /metrics")
    finally:
        stack.down()


def test_flood_gets_only_200_or_429_and_memory_stays_bounded(tmp_path, tiny_model):
    # nginx.worker_connections set below the flood: nginx is given room for what the frontends
    # admit and a margin of clients past it (nginx_options.worker_connections), where 1,024 dropped
    # connections unanswered ("worker_connections are not enough") and no 429 came.
    stack = Stack(tmp_path / "s", tiny_overrides(
        tiny_model, frontends={"count": 2, "max_inflight": 16}, workers={"queue_texts": 96},
        nginx={"worker_connections": 1024}))
    stack.up()
    try:
        programs = {"frontend-0": "frontends:frontend-0", "frontend-1": "frontends:frontend-1",
                    "worker-0": "workers:worker-0", "nginx": "nginx"}
        procs = {name: psutil.Process(stack.pid(prog)) for name, prog in programs.items()}
        peak = {name: 0 for name in procs}
        done = threading.Event()

        def sample():
            while not done.is_set():
                for name, proc in procs.items():
                    members = [proc] + proc.children(recursive=True)
                    rss = sum(p.memory_info().rss for p in members)
                    peak[name] = max(peak[name], rss)
                done.wait(0.1)

        sampler = threading.Thread(target=sample)
        sampler.start()

        async def flood():
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(stack.url, connector=conn) as session:
                async def one(i):
                    texts = [f"flood {i} {j} " * (1 + j % 7) for j in range(8)]
                    async with session.post("/predict", json={"texts": texts}) as resp:
                        await resp.read()
                        return resp.status
                # Every request at once: far past what two frontends and a worker sustain.
                return await asyncio.gather(*(one(i) for i in range(1500)))

        try:
            statuses = asyncio.run(flood())
        finally:
            done.set()
            sampler.join()
        counts = {s: statuses.count(s) for s in set(statuses)}
        assert set(counts) <= {200, 429}, counts
        assert counts.get(200, 0) > 0 and counts.get(429, 0) > 0, counts
        # Each 429's access line says what refused it (all read `error: overloaded`: outside check)
        stack.wait_until(lambda: sum(refusal_reasons(stack, 2).values()) == counts[429], 10,
                         "every 429's access line")
        reasons = refusal_reasons(stack, 2)
        assert set(reasons) <= {"inflight", "deadline", "arena", "worker_overloaded",
                                "worker_past_deadline"}, reasons
        assert reasons["inflight"] > 0, reasons
        for name, rss in peak.items():
            limit = RSS_LIMITS_MB[name.split("-")[0]]
            assert rss < limit << 20, f"{name} peaked at {rss >> 20} MB (limit {limit})"
        assert stack.post_json("/predict", {"texts": ["calm again"]})[0] == 200
    finally:
        stack.down()


def _refused(stack: Stack, by: str = "worker") -> dict[str, float]:
    _, _, raw = stack.get("/metrics")
    return {s.labels["reason"]: s.value
            for f in text_string_to_metric_families(raw.decode()) for s in f.samples
            if s.name == f"shmserve_{by}_refused_total"}


def _computed(stack: Stack) -> tuple[float, float]:
    """(real tokens, forward seconds) the workers have computed so far, from /metrics."""
    _, _, raw = stack.get("/metrics")
    sums = collections.Counter()
    for family in text_string_to_metric_families(raw.decode()):
        for s in family.samples:
            if s.name in ("shmserve_batch_tokens_sum", "shmserve_batch_forward_seconds_sum"):
                sums[s.name] += s.value
    return sums["shmserve_batch_tokens_sum"], sums["shmserve_batch_forward_seconds_sum"]


def _speed(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Tokens a forward-second between two `_computed` readings."""
    return (after[0] - before[0]) / max(after[1] - before[1], 1e-9)


def _burst_past_the_deadline(stack: Stack, speed: float) -> tuple[collections.Counter, float]:
    """Requests of 8 medium texts at once with a 3 s deadline, ~3x what the worker finishes in
    time at `speed` (a fixed 60 all fitted on a CPU with AMX): what cannot make it must be
    refused at once (429). Returns the counts of each status and the worker's speed in the
    burst (`_speed`), for the caller to judge whether the admitted work was answered in time."""
    requests = min(400, max(60, math.ceil(3 * 3.0 * speed / (8 * MEDIUM_TOKENS))))
    async def burst():
        connector = aiohttp.TCPConnector(limit=0)  # every request at once, not 100 at a time
        async with aiohttp.ClientSession(stack.url, connector=connector) as session:
            async def one(i):
                started = time.perf_counter()
                async with session.post("/predict", json={"texts": [MEDIUM + str(i)] * 8},
                                        headers={"X-Request-Timeout": "3"}) as resp:
                    body = await resp.json()
                    if resp.status == 429:
                        _fits_retry_after(body["error"]["message"], resp.headers["Retry-After"])
                    return resp.status, time.perf_counter() - started
            return await asyncio.gather(*(one(i) for i in range(requests)))

    before, before_frontend = _refused(stack), _refused(stack, "frontend")
    seen = refusal_reasons(stack, 1)
    computed = _computed(stack)
    answers = asyncio.run(burst())
    speed = _speed(computed, _computed(stack))
    counts = collections.Counter(status for status, _ in answers)
    assert set(counts) <= {200, 429, 504}, counts
    assert counts[200] >= 3 and counts[429] >= 10, counts
    refused = [seconds for status, seconds in answers if status == 429]
    assert statistics.median(refused) < 1.5, refused
    after = _refused(stack)  # counters of a restarted worker carry on (shmserve.reaper)
    by_reason = {reason: after[reason] - before.get(reason, 0) for reason in after}
    frontend = _refused(stack, "frontend")
    early = {reason: frontend[reason] - before_frontend[reason] for reason in frontend}
    # Refused by the worker, or by the frontend from the worker's heartbeats (after tokenizing:
    # these texts are long, tokenized in a thread); every 429 is one of the two.
    assert early["inflight"] == 0 and by_reason["queue_full"] == 0, (early, by_reason)
    assert by_reason["deadline"] + early["deadline"] == counts[429], (by_reason, early, counts)
    # ... and each access line says which (the worker's read worker_overloaded: outside check)
    stack.wait_until(lambda: sum((refusal_reasons(stack, 1) - seen).values()) == counts[429],
                     10, "every 429's access line")
    assert refusal_reasons(stack, 1) - seen == +collections.Counter(
        {"worker_past_deadline": by_reason["deadline"], "deadline": early["deadline"]})
    return counts, speed


def _admitted_work_is_answered_in_time(stack: Stack, speed: float, again=None) -> None:
    """A burst's admitted work is mostly finished in time (the estimate is of a recent speed,
    `speed` tokens a forward-second as the test measured it): at most one 504 for four 200s.
    The estimate cannot hold when another job takes the cores in the middle of the burst (the
    suite's other process on two cores: 4-9 x 504 against 10-21 x 200 in two CI runs), so a
    burst whose forwards ran under SHARE of `speed` (a slowdown past the margin the rule
    keeps) is tried again, after `again`, up to three times; one that missed at its speed
    fails at once."""
    tried = []
    for attempt in range(3):
        if attempt and again is not None:
            again()
        counts, burst_speed = _burst_past_the_deadline(stack, speed)
        tried.append((dict(counts), round(burst_speed / speed, 2)))
        if counts[504] <= counts[200] // 4:
            return
        assert burst_speed < SHARE * speed, ("504s at the speed the estimate assumed", tried)
    pytest.fail(f"every burst ran slower than the margin, with 504s: {tried}")


def _fits_retry_after(message: str, retry_after: str) -> None:
    """A deadline refusal's Retry-After is when the same request would be admitted (the time
    its message says the work ahead needs, less the admission share of its deadline), spread
    over up to twice that, in whole seconds from 1 to 60; it was always 1."""
    found = re.search(r"needs ~([0-9.]+) s .* deadline in ([0-9.]+) s", message)
    assert found, message
    wait = float(found[1]) - SHARE * float(found[2])  # each shown to 0.1 s: +-0.09 here
    lo, hi = max(1, math.ceil(wait - 0.09)), min(60, max(1, math.ceil(2 * (wait + 0.09))))
    assert lo <= int(retry_after) <= hi, (message, retry_after)


def _refused_before_tokenizing(stack: Stack) -> None:
    """With work queued for longer than a request's deadline allows, the frontend refuses it
    from the worker's heartbeats before tokenizing it, and the worker never sees it."""
    async def scenario():
        async with aiohttp.ClientSession(stack.url) as session:
            async def post(texts, deadline):
                async with session.post("/predict", json={"texts": texts},
                                        headers={"X-Request-Timeout": deadline}) as resp:
                    body = await resp.json()
                    if resp.status == 429:
                        _fits_retry_after(body["error"]["message"], resp.headers["Retry-After"])
                    return resp.status, resp.headers.get("Retry-After")

            backlog = [asyncio.create_task(post([MEDIUM + str(i)] * 8, "60"))
                       for i in range(40)]
            while queued_texts(stack) < 48:  # what the heartbeats say, as /ready shows it
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # a heartbeat after it
            before = _refused(stack), _refused(stack, "frontend")
            short = [await post(["a short query"], "0.5") for _ in range(5)]
            after = _refused(stack), _refused(stack, "frontend")
            assert [status for status, _ in short] == [429] * 5, short
            assert after[1]["deadline"] - before[1]["deadline"] == 5, (before, after)
            assert after[0]["deadline"] == before[0]["deadline"], (before, after)
            assert [status for status, _ in await asyncio.gather(*backlog)] == [200] * 40

    asyncio.run(scenario())


def test_a_burst_past_the_deadline_is_refused_at_once_not_timed_out(tmp_path, slow_model):
    """(workers.refuse_past_deadline), once the worker has drained a backlog."""
    stack = slow_stack(tmp_path / "s", slow_model, frontends={"count": 1},
                       batching={"max_batch_size": 8}, workers={"torch_threads": 1})
    stack.up()
    try:
        # Two requests of 16 texts at once: passes of 8 with texts left waiting, so the worker
        # measures the speed it drains a backlog at.
        computed = _computed(stack)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            warm = list(pool.map(lambda _: stack.post_json("/predict", {"texts": [MEDIUM] * 16}),
                                 range(2)))
        assert [status for status, _, _ in warm] == [200, 200]
        speed = _speed(computed, _computed(stack))  # what the worker's estimate starts from
        _admitted_work_is_answered_in_time(stack, speed)
        _refused_before_tokenizing(stack)
        # ... and the same when it meets a restarted worker: its first estimate is its warm-up's
        # timed pass (an outside check found 32-124 x 504 of 300 in the first burst after a
        # start, when a fresh worker had no estimate and admitted everything).
        def restart():
            stack.cli("restart", "workers")  # returns once the new worker is ready

        restart()
        _admitted_work_is_answered_in_time(stack, speed, again=restart)
    finally:
        stack.down()
