"""A frontend's early refusal (WorkerPool.behind): what every ready worker's admission rule
would refuse, judged from its heartbeats, before tokenizing."""

import time

from frontend.pool import WorkerPool
from shmserve.admission import SHARE
from shmserve.protocol import PROTOCOL_VERSION, Heartbeat, ModelInfo, Queued

RATE = 1000.0  # tokens/s each worker drains a backlog at, in the heartbeats below


def beat(pool: WorkerPool, index: int, *queued: Queued, rate: float = RATE,
         served: str = "a") -> None:
    info = ModelInfo(served, "embedding", 4, 8, "fp32", "r", "ready", "")
    pool._on_heartbeat(pool.links[index], Heartbeat(
        PROTOCOL_VERSION, index, 1_000_000 + index, True, "cpu", (info,), 0, 10, 0.0, 0.0,
        rate, 0.1, tuple(queued)))


def due(seconds: float) -> float:
    return time.time() + seconds


def test_refused_only_when_every_ready_worker_is_too_far_behind(pool):
    beat(pool, 0, Queued(0, 5000))  # 5 s + a pass of 0.1 s
    beat(pool, 1, Queued(0, 6000))
    why = pool.behind("a", 0, due(6.0))  # 0.75 x 6 = 4.5 s < 5.1 s
    assert why is not None and "every worker's queue needs ~5.1 s" in why.why
    # the same request is admitted once 5.1 - 4.5 s drained: Retry-After 1, spread to 2
    assert why.retry_after_s in (1, 2)
    assert pool.behind("a", 0, due(5.2 / SHARE)) is None  # worker 0 makes it
    # ... unless the request's own tokens, once known, do not fit either
    assert pool.behind("a", 0, due(5.2 / SHARE), tokens=1000) is not None
    beat(pool, 1)  # worker 1 drained its queue: always admitted there
    assert pool.behind("a", 0, due(1.0)) is None
    # a request too large for its deadline alone is admitted once a queue has drained: its
    # Retry-After is that, not the most (60 s: an outside check)
    beat(pool, 0, Queued(0, 300))
    beat(pool, 1, Queued(0, 2000))
    why = pool.behind("a", 0, due(4.0), tokens=40_000)
    assert why is not None and why.retry_after_s == 1, why


def test_work_below_the_request_priority_is_not_ahead_of_it(pool):
    for index in (0, 1):
        beat(pool, index, Queued(-1, 50_000), Queued(1, 1000))
    assert pool.behind("a", -1, due(10.0)) is not None
    assert pool.behind("a", 0, due(10.0)) is None  # 1.1 s of high work ahead
    assert pool.behind("a", 0, due(1.2)) is not None
    assert pool.behind("a", 2, due(0.1)) is None  # nothing ahead: always admitted


def test_no_speed_measured_no_refusal(pool):
    for index in (0, 1):
        beat(pool, index, Queued(0, 10**9), rate=0.0)
    assert pool.behind("a", 0, due(0.5)) is None


def test_a_heartbeat_ages_by_what_the_worker_drained_since(pool):
    for index in (0, 1):
        beat(pool, index, Queued(0, 5000))
    assert pool.behind("a", 0, due(6.0)) is not None
    for link in pool.links:
        link.last_beat -= 2.0  # 2,000 tokens drained since: 3.1 s left
    assert pool.behind("a", 0, due(6.0)) is None
    assert pool.behind("a", 0, due(4.0)) is not None


def test_no_ready_worker_for_the_model_is_not_an_early_refusal(pool):
    for index in (0, 1):
        beat(pool, index, Queued(0, 10**6), served="b")
    assert pool.behind("a", 0, due(1.0)) is None  # the dispatcher answers 503 for that
    assert pool.behind("b", 0, due(1.0)) is not None
