"""Dispatcher: which worker a request goes to when the first one turns it away."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from frontend import metrics
from frontend.dispatch import Dispatcher
from frontend.errors import ApiError
from frontend.links import WorkerClosed, WorkerGone, WorkerLink
from frontend.tokenizer import Encoded
from shmserve import config
from shmserve.arena import Arena
from shmserve.protocol import Error, ErrorCode, Heartbeat, ModelInfo, Result

MODEL = ModelInfo("m", "embedding", 4, 16, "fp32", "r1", "ready", "")


class FakePool:
    """Two ready workers; each answers every Submit with what `answers` holds for it
    ("silent": the request fails over, and the worker keeps its slot until `settle_held`)."""

    def __init__(self, answers: dict[int, ErrorCode | str | None]) -> None:
        self.links = [WorkerLink(i, f"ipc://w{i}", None, alive=True,
                                 beat=Heartbeat(3, i, 100 + i, True, "cpu", (MODEL,), 0, 64,
                                                0.0, 0.0))
                      for i in range(len(answers))]
        self.answers = answers
        self.sent: list[int] = []
        self.outputs = []  # each Submit's output handle
        self.tokens: list[int] = []  # the work each Submit is counted as on its worker
        self.held = []  # the on_settled of requests a silent worker still holds
        self._seq = 0

    def pick(self, model: str, avoid=None):
        # the lowest index first, as idle workers go round; `avoid` last
        ready = sorted(self.ready_links(model), key=lambda link: link is avoid)
        return ready[0] if ready else None

    async def wait_for_worker(self, model: str, timeout: float, avoid=None):
        return self.pick(model, avoid)

    def ready_links(self, model: str):
        return [link for link in self.links if link.ready]

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def submit(self, link, msg, tokens, on_settled):
        self.sent.append(link.index)
        self.tokens.append(tokens)
        self.outputs.append(msg.output)
        future = asyncio.get_running_loop().create_future()
        code = self.answers[link.index]
        if code == "silent":
            future.set_exception(WorkerGone("silent"))
            link.alive = False
            self.held.append(on_settled)
            return future
        if code == "closed":  # stopped, saying it ran none of it (protocol.Closing)
            future.set_exception(WorkerClosed("closed"))
            link.alive = False
            on_settled()
            return future
        future.set_result(Result(msg.seq, 0.1, 1.0, 1, 3, "r1") if code is None
                          else Error(msg.seq, code, "no"))
        on_settled()
        return future

    def mark_unready(self, link) -> None:
        from dataclasses import replace

        link.beat = replace(link.beat, ready=False)


@pytest.fixture
def arena(tmp_path):
    arena = Arena("shmserve-test-dispatch", 1 << 20, directory=tmp_path)
    yield arena
    arena.close()


def run(pool, arena, retries: int | None = None):
    cfg = config.load(environ={} if retries is None else {
        "SHMSERVE__FRONTENDS__RETRY_ON_WORKER_LOSS": str(retries)})
    enc = Encoded(np.array([101, 7, 102], np.int32), np.array([0, 3], np.int32), 0)
    return asyncio.run(Dispatcher(cfg, pool, arena).run("m", 4, enc, "req", time.time() + 5))


def test_a_worker_that_is_loading_or_draining_hands_the_request_to_another(arena):
    pool = FakePool({0: ErrorCode.UNAVAILABLE, 1: None})
    outcome = run(pool, arena)
    assert outcome.worker == 1 and pool.sent == [0, 1] and outcome.attempts == 2
    assert not pool.links[0].ready  # routed around until its next heartbeat
    # Each worker is charged the request's tokens (3 ids), not its texts (1), while it holds
    # it: a frontend routes by tokens outstanding (WorkerPool.pick, tests/unit/test_routing.py)
    assert pool.tokens == [3, 3]


def test_a_worker_that_refuses_for_its_load_hands_the_request_to_another_once(arena):
    # A frontend knows the other workers' load from heartbeats that may be a moment old: a
    # 429 came from a busy worker while the other was idle (an outside check).
    pool = FakePool({0: ErrorCode.OVERLOADED, 1: None})
    before = metrics.RETRIES.labels("overloaded")._value.get()
    outcome = run(pool, arena)
    assert outcome.worker == 1 and pool.sent == [0, 1] and outcome.attempts == 2
    metrics.turn.flush()
    assert metrics.RETRIES.labels("overloaded")._value.get() == before + 1
    assert pool.links[0].ready  # busy, not unready
    # ... as one refused for the work queued ahead of its deadline, which its access line
    # names apart from a full queue (an outside check read worker_overloaded for both)
    pool = FakePool({0: ErrorCode.PAST_DEADLINE, 1: None})
    assert run(pool, arena).worker == 1 and pool.sent == [0, 1]
    pool = FakePool({0: ErrorCode.PAST_DEADLINE, 1: ErrorCode.PAST_DEADLINE})
    with pytest.raises(ApiError) as err:
        run(pool, arena)
    assert err.value.status == 429 and err.value.reason == "worker_past_deadline"
    # Both refuse: the 429 after one more try, not a round of every worker
    pool = FakePool({0: ErrorCode.OVERLOADED, 1: ErrorCode.OVERLOADED})
    with pytest.raises(ApiError) as err:
        run(pool, arena)
    assert err.value.status == 429 and pool.sent == [0, 1]
    # No other worker ready: the 429 at once
    pool = FakePool({0: ErrorCode.OVERLOADED, 1: None})
    pool.mark_unready(pool.links[1])
    with pytest.raises(ApiError) as err:
        run(pool, arena)
    assert err.value.status == 429 and pool.sent == [0]


def test_only_a_workers_loss_counts_against_retry_on_worker_loss(arena):
    """An overload's or a draining worker's hand-off used one of the worker-loss attempts: on
    the last one, the refusal came back as 503 "retries exhausted" (Retry-After 1, the worker's
    estimate lost), and with no retries configured every overload did (a review)."""
    # No retries on loss: both overloaded is still a 429 after the one hand-off.
    pool = FakePool({0: ErrorCode.OVERLOADED, 1: ErrorCode.OVERLOADED})
    with pytest.raises(ApiError) as err:
        run(pool, arena, retries=0)
    assert err.value.status == 429 and pool.sent == [0, 1]
    # ... and a draining worker hands the request to the ready one.
    pool = FakePool({0: ErrorCode.UNAVAILABLE, 1: None})
    assert run(pool, arena, retries=0).worker == 1 and pool.sent == [0, 1]
    # Two lost (the default allowance), then one overloaded: the fourth worker serves it.
    pool = FakePool({0: "silent", 1: "silent", 2: ErrorCode.OVERLOADED, 3: None})
    outcome = run(pool, arena)
    assert outcome.worker == 3 and pool.sent == [0, 1, 2, 3] and outcome.attempts == 4
    # Lost past the allowance: 503, retries exhausted, saying how many tries.
    pool = FakePool({0: "silent", 1: "silent", 2: "silent", 3: None})
    with pytest.raises(ApiError) as err:
        run(pool, arena)
    assert err.value.status == 503 and "retries exhausted" in err.value.message
    assert pool.sent == [0, 1, 2] and err.value.attempts == 3
    # Every worker draining: each tried once, then a 503.
    pool = FakePool({0: ErrorCode.UNAVAILABLE, 1: ErrorCode.UNAVAILABLE})
    with pytest.raises(ApiError) as err:
        run(pool, arena)
    assert err.value.status == 503 and pool.sent == [0, 1]


def test_a_worker_that_stopped_without_running_the_request_hands_it_on_as_a_draining_one(arena):
    """A worker that stops says so after its last answer (protocol.Closing): what it had not
    answered never ran, so it goes to another worker without a lost worker's retry."""
    before = metrics.RETRIES.labels("unavailable")._value.get()
    pool = FakePool({0: "closed", 1: None})
    outcome = run(pool, arena, retries=0)
    assert outcome.worker == 1 and pool.sent == [0, 1] and outcome.attempts == 2
    metrics.turn.flush()
    assert metrics.RETRIES.labels("unavailable")._value.get() == before + 1
    pool = FakePool({0: "closed", 1: "closed"})
    with pytest.raises(ApiError) as err:
        run(pool, arena, retries=0)
    assert err.value.status == 503 and pool.sent == [0, 1] and arena.bytes_used == 0


def test_other_worker_errors_are_the_answer(arena):
    pool = FakePool({0: ErrorCode.DEADLINE, 1: None})
    with pytest.raises(ApiError) as err:
        run(pool, arena)
    assert err.value.status == 504 and pool.sent == [0]


def test_with_no_ready_worker_the_503_says_whether_they_are_loading_or_gone(arena):
    pool = FakePool({0: None, 1: None})
    for link in pool.links:  # alive (heartbeating), still loading
        pool.mark_unready(link)
    with pytest.raises(ApiError) as err:
        run(pool, arena)
    assert err.value.status == 503
    assert err.value.message == "no worker is ready for this model yet (loading or restarting)"
    for link in pool.links:
        link.alive = False
    with pytest.raises(ApiError) as err:
        run(pool, arena)
    assert err.value.status == 503 and err.value.message == "no live worker for this model"


def test_a_wait_for_a_worker_that_the_deadline_cuts_short_is_a_504_not_a_503(arena):
    """A request whose deadline is shorter than frontends.no_worker_wait_s, with no worker
    ready (a frontend just started, not yet told of its workers): its deadline ends the wait,
    a 504; "no live worker" (503) was said of live workers (an outside check). The wait's timer
    may end a moment before the deadline itself (here: at once, as a timer that fires early)."""
    class NotYetTold(FakePool):
        waited: list[float] = []

        async def wait_for_worker(self, model, timeout, avoid=None):
            self.waited.append(timeout)
            return None
    pool = NotYetTold({0: None, 1: None})
    for link in pool.links:
        pool.mark_unready(link)
    cfg = config.load(environ={})
    enc = Encoded(np.array([101, 7, 102], np.int32), np.array([0, 3], np.int32), 0)

    def run_until(seconds):
        return asyncio.run(Dispatcher(cfg, pool, arena).run("m", 4, enc, "req",
                                                           time.time() + seconds))
    with pytest.raises(ApiError) as err:
        run_until(0.02)
    assert err.value.status == 504 and err.value.message == "deadline passed waiting for a worker"
    assert pool.waited[-1] <= 0.02
    with pytest.raises(ApiError) as err:  # the server's own wait ran out first: a 503
        run_until(cfg.frontends.no_worker_wait_s + 5)
    assert err.value.status == 503 and pool.waited[-1] == cfg.frontends.no_worker_wait_s
    assert arena.bytes_used == 0


def test_a_resubmission_writes_rows_of_its_own_while_the_silent_worker_holds_the_first(arena):
    # A worker failed over for silence may resume and write the rows it was given: the next
    # worker's answer must be read from other rows, and the first stay allocated until the
    # silent worker is done with them.
    pool = FakePool({0: "silent", 1: None})
    lost = metrics.RETRIES.labels("worker_lost")._value.get()
    outcome = run(pool, arena)
    assert outcome.worker == 1 and pool.sent == [0, 1] and outcome.attempts == 2
    metrics.turn.flush()
    assert metrics.RETRIES.labels("worker_lost")._value.get() == lost + 1
    first, second = pool.outputs
    assert (first.offset + first.nbytes <= second.offset
            or second.offset + second.nbytes <= first.offset)
    assert arena.bytes_used > 0  # the first slot, held for the silent worker
    pool.held.pop()()
    assert arena.bytes_used == 0


def test_a_retry_is_counted_when_sent_and_a_failed_one_says_how_many_tries_it_had(arena):
    """shmserve_frontend_retries_total counts requests sent again to a worker: one whose
    worker died with no other to take it was counted, though nothing was sent again (an
    outside check); and a request tried twice that failed had no `attempts` on its line."""
    pool = FakePool({0: "silent", 1: None})
    pool.mark_unready(pool.links[1])  # no other worker: 503, after the one attempt
    lost = metrics.RETRIES.labels("worker_lost")._value.get()
    with pytest.raises(ApiError) as err:
        run(pool, arena)
    metrics.turn.flush()
    assert err.value.status == 503 and pool.sent == [0] and err.value.attempts == 1
    assert metrics.RETRIES.labels("worker_lost")._value.get() == lost
    # its access line says its worker was lost, not that none was ready (an outside check
    # could not tell a lost worker's 503s from a cold start's)
    assert err.value.reason == "worker_lost", err.value.reason
    assert err.value.message.startswith("its worker was lost and no worker is ready")
    pool = FakePool({0: ErrorCode.OVERLOADED, 1: ErrorCode.OVERLOADED})
    with pytest.raises(ApiError) as err:
        run(pool, arena)
    assert err.value.status == 429 and pool.sent == [0, 1] and err.value.attempts == 2


def test_a_per_token_request_gets_a_row_for_every_token_and_is_bounded(arena):
    cfg = config.load(environ={})
    pool = FakePool({0: None, 1: None})
    enc = Encoded(np.arange(7, dtype=np.int32), np.array([0, 3, 7], np.int32), 0)
    asyncio.run(Dispatcher(cfg, pool, arena).run("m", 4, enc, "req", time.time() + 5,
                                                 per_token=True))
    assert pool.outputs[0].shape == (7, 4)  # tokens x dim, not texts x dim
    # 1 MiB arena: a quarter is 65,536 floats; 4,097 tokens x 16 floats is one too many.
    big = Encoded(np.ones(4097, np.int32), np.array([0, 4097], np.int32), 0)
    with pytest.raises(ApiError) as info:
        asyncio.run(Dispatcher(cfg, pool, arena).run("m", 16, big, "req", time.time() + 5,
                                                     per_token=True))
    assert info.value.status == 413 and "shm.arena_mb" in info.value.message
    assert len(pool.outputs) == 1  # refused before any worker saw it
    fits = Encoded(np.ones(4096, np.int32), np.array([0, 4096], np.int32), 0)
    asyncio.run(Dispatcher(cfg, pool, arena).run("m", 16, fits, "req", time.time() + 5,
                                                  per_token=True))
    assert pool.outputs[1].shape == (4096, 16)


def test_a_full_arena_is_a_429_that_says_so(arena):
    """It said "too many requests in flight on this frontend" with frontends.max_inflight far
    off, and no refusal reason counted it (an outside check)."""
    from frontend import metrics

    cfg = config.load(environ={})
    before = metrics.REFUSED.labels("arena")._value.get()
    huge = Encoded(np.ones(300_000, np.int32), np.array([0, 300_000], np.int32), 0)  # > 1 MiB
    with pytest.raises(ApiError) as info:
        asyncio.run(Dispatcher(cfg, FakePool({0: None, 1: None}), arena).run(
            "m", 4, huge, "req", time.time() + 5))
    assert info.value.status == 429 and "shm.arena_mb" in info.value.message
    metrics.turn.flush()
    assert metrics.REFUSED.labels("arena")._value.get() == before + 1


def test_a_full_dev_shm_is_a_503_that_says_so(arena, monkeypatch):
    """/dev/shm filled by others: the request is refused before any worker writes a page tmpfs
    cannot give (SIGBUS killed the frontends and workers before)."""
    from shmserve.arena import ShmFull

    def full(nbytes):
        raise ShmFull("/dev/shm is full: no room for 1,048,576 more bytes")
    monkeypatch.setattr(arena, "alloc", full)
    before = metrics.REFUSED.labels("shm_full")._value.get()
    pool = FakePool({0: None, 1: None})
    with pytest.raises(ApiError) as err:
        run(pool, arena)
    metrics.turn.flush()
    assert err.value.status == 503 and err.value.retry_after == 5 and pool.sent == []
    assert "no shared memory for this request: /dev/shm is full" in err.value.message
    assert metrics.REFUSED.labels("shm_full")._value.get() == before + 1


def test_a_models_revision_is_a_ready_workers_while_another_restarts():
    """A restarting worker reports the model with no revision while it loads: /info said
    revision null for ~6 s of a rolling restart though the other worker served (an outside
    check). A ready worker's report wins, then one that names a revision."""
    from dataclasses import replace

    from frontend.pool import WorkerPool

    pool = FakePool({0: None, 1: None})
    loading = replace(MODEL, revision="", state="loading")
    pool.links[0].beat = replace(pool.links[0].beat, ready=False, models=(loading,))
    assert WorkerPool.model_info(pool, "m").revision == "r1"  # worker 1's, ready
    pool.links[1].alive = False  # lost too: the one that names a revision
    assert WorkerPool.model_info(pool, "m").revision == "r1"
    pool.links[1].beat = replace(pool.links[1].beat, models=())
    assert WorkerPool.model_info(pool, "m") is loading
    assert WorkerPool.model_info(pool, "other") is None
