"""Which worker a frontend sends a request to (WorkerPool.pick): the one with the least
outstanding work counted in tokens, not texts."""

import asyncio

from frontend.pool import WorkerPool
from shmserve.protocol import (PROTOCOL_VERSION, Heartbeat, ModelInfo, Queued, Result,
                               ShmHandle, Submit)


def beat(pool: WorkerPool, index: int, *queued: Queued) -> None:
    info = ModelInfo("a", "embedding", 4, 8, "fp32", "r", "ready", "")
    pool._on_heartbeat(pool.links[index], Heartbeat(
        PROTOCOL_VERSION, index, 1_000_000 + index, True, "cpu", (info,), 0, 10, 0.0, 0.0,
        1000.0, 0.1, tuple(queued)))


def submit(pool: WorkerPool, index: int, tokens: int) -> int:
    handle = ShmHandle("arena", 0, 4, "int32", (1,))
    seq = pool.next_seq()
    pool.submit(pool.links[index], Submit(seq, f"r{seq}", "a", handle, handle, handle, 1e12, 0,
                                          handle), tokens, lambda: None)
    return seq


def test_a_worker_with_one_long_text_is_busier_than_one_with_two_short_ones(pool):
    async def run() -> None:
        for index in (0, 1):
            beat(pool, index)
        long = submit(pool, 0, 180)  # one text of 180 tokens: ~30 ms on a CPU core
        submit(pool, 1, 12)
        submit(pool, 1, 15)  # two of ~12-15 tokens: ~10 ms
        assert pool.pick("a") is pool.links[1]
        # Once the long one is answered, worker 0 has nothing outstanding
        pool._settle(pool.links[0], Result(long, 1.0, 30.0, 1, 180, "r"))
        assert pool.links[0].outstanding == 0 and pool.links[1].outstanding == 27
        assert pool.pick("a") is pool.links[0]
        for link in pool.links:  # nothing is sent: the test ends before the loop flushes
            link.outbox.clear()
            link.pending.clear()

    asyncio.run(run())


def test_with_nothing_outstanding_here_what_the_workers_report_decides(pool):
    # Another frontend's requests: worker 0 reports 400 tokens queued at one priority, worker 1
    # 150 over two; tokens, not the number of priorities or texts, decide.
    beat(pool, 0, Queued(0, 400))
    beat(pool, 1, Queued(0, 100), Queued(1, 50))
    assert pool.pick("a") is pool.links[1]
    beat(pool, 1, Queued(0, 300), Queued(1, 200))
    assert pool.pick("a") is pool.links[0]


def test_idle_workers_take_turns(pool):
    # At light load every worker is idle when a request comes: the lowest index took them all,
    # and the deployment's other workers sat idle and cold.
    for index in (0, 1):
        beat(pool, index)
    picked = [pool.pick("a").index for _ in range(6)]
    assert sorted(picked) == [0, 0, 0, 1, 1, 1], picked
    assert all(a != b for a, b in zip(picked, picked[1:])), picked
    # Work outstanding still decides before the turn does.
    async def run() -> None:
        submit(pool, 0, 5)
        assert [pool.pick("a").index for _ in range(3)] == [1, 1, 1]
        for link in pool.links:
            link.outbox.clear()
            link.pending.clear()

    asyncio.run(run())


def test_a_worker_to_avoid_is_picked_only_when_no_other_is_ready(pool):
    # dispatch: the retry of a request one worker refused for its load goes to another
    for index in (0, 1):
        beat(pool, index)
    beat(pool, 1, Queued(0, 500))  # busier than worker 0, and still chosen over it
    assert all(pool.pick("a", avoid=pool.links[0]) is pool.links[1] for _ in range(4))
    pool.links[1].beat = None  # not ready
    assert pool.pick("a", avoid=pool.links[0]) is pool.links[0]


def test_another_frontends_backlog_counts_beside_this_ones_few_tokens(pool):
    # Worker 1 holds another frontend's 56,000 tokens; worker 0 this frontend's one query of
    # 10: a query went to worker 1 and waited 7-9 s behind it (an outside check).
    async def run() -> None:
        beat(pool, 0)
        beat(pool, 1, Queued(0, 56_000))
        submit(pool, 0, 10)
        assert pool.pick("a") is pool.links[0]
        # ... less what the worker has drained since its heartbeat, at its speed (1,000
        # tokens/s here): 56 s later worker 1's backlog is gone
        pool.links[1].last_beat -= 56.0
        assert pool.pick("a") is pool.links[1]
        for link in pool.links:
            link.outbox.clear()
            link.pending.clear()

    asyncio.run(run())
