"""A large request at light load runs spread over the idle workers of its model
(frontend.dispatch: spread_cuts, split, joined, Dispatcher.run)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from frontend import metrics
from frontend.dispatch import Dispatcher, joined, split, spread_cuts
from frontend.errors import ApiError
from frontend.links import WorkerLink
from frontend.tokenizer import Encoded
from shmserve import config
from shmserve.arena import Arena
from shmserve.protocol import Error, ErrorCode, Heartbeat, ModelInfo, Queued, Result

MODEL = ModelInfo("m", "embedding", 4, 16, "fp32", "r1", "ready", "")
DIM = 4


def encoded(lengths: list[int], pairs: bool = False) -> Encoded:
    """Texts of these token counts; each token id is its text's index * 1000 + its place."""
    ids = np.concatenate([np.arange(n, dtype=np.int32) + 1000 * i
                          for i, n in enumerate(lengths)])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    segments = np.array([n // 2 for n in lengths], np.int32) if pairs else None
    return Encoded(ids, offsets, 2, segments, skip=1)


class Pool:
    """Ready workers that answer each Submit on the next loop turns (so a request counts as
    outstanding on its worker while its siblings pick theirs), writing for each text a row of
    its first token id, its token count, its segment, and the worker."""

    def __init__(self, workers: int, revisions: dict[int, str] | None = None,
                 fail: dict[int, ErrorCode] | None = None) -> None:
        self.links = [WorkerLink(i, f"ipc://w{i}", None, alive=True,
                                 beat=Heartbeat(3, i, 100 + i, True, "cpu", (MODEL,), 0, 64,
                                                0.0, 0.0))
                      for i in range(workers)]
        self.revisions = revisions or {}
        self.fail = fail or {}
        self.arena: Arena | None = None
        self.sent: list[tuple[int, int]] = []  # (worker, texts) of each Submit
        self.aborted: list[int] = []
        self.priorities: list[int] = []  # each Submit's
        self._seq = 0

    def ready_links(self, model: str):
        return [link for link in self.links if link.ready]

    def idle(self, model: str) -> int:  # as WorkerPool.idle counts them
        now = time.monotonic()
        return sum(1 for link in self.ready_links(model) if link.load(now) <= 0)

    def pick(self, model: str, avoid=None):
        return min(self.ready_links(model),
                   key=lambda link: (link is avoid, link.outstanding, link.index))

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def submit(self, link, msg, tokens, on_settled):
        offsets = self.arena.view(msg.offsets).copy()
        self.sent.append((link.index, len(offsets) - 1))
        self.priorities.append(msg.priority)
        link.outstanding += tokens
        future = asyncio.get_running_loop().create_future()

        def answer() -> None:
            link.outstanding -= tokens
            if link.index in self.fail:
                future.set_result(Error(msg.seq, self.fail[link.index], "no"))
            elif not future.done():
                ids, rows = self.arena.view(msg.token_ids), self.arena.view(msg.output)
                segments = self.arena.view(msg.segments)
                for i in range(len(offsets) - 1):
                    rows[i] = (ids[offsets[i]], offsets[i + 1] - offsets[i],
                               segments[i] if len(segments) else -1, link.index)
                future.set_result(Result(msg.seq, 0.5 + link.index, 2.0 + link.index,
                                         len(offsets) - 1, tokens,
                                         self.revisions.get(link.index, "r1")))
            on_settled()

        asyncio.get_running_loop().call_later(0.01 * (1 + link.index), answer)
        return future

    def abort(self, link, seq: int) -> None:
        self.aborted.append(link.index)


@pytest.fixture
def arena(tmp_path):
    arena = Arena("shmserve-test-spread", 1 << 20, directory=tmp_path)
    yield arena
    arena.close()


def dispatch(pool, arena, enc: Encoded, part_texts: int = 4):
    pool.arena = arena
    cfg = config.load(environ={"SHMSERVE__FRONTENDS__SPREAD_PART_TEXTS": str(part_texts)})
    return asyncio.run(Dispatcher(cfg, pool, arena).run("m", DIM, enc, "req",
                                                        time.time() + 5))


def expected_rows(enc: Encoded) -> np.ndarray:
    """Each text's first token id, token count and segment, as the fake workers write them."""
    segments = enc.segments if enc.segments is not None else np.full(enc.count, -1)
    return np.stack([enc.ids[enc.offsets[:-1]], np.diff(enc.offsets), segments], 1)


def test_cuts_share_the_tokens_and_keep_each_part_at_least_so_many_texts():
    offsets = np.arange(0, 101, dtype=np.int32) * 10  # 100 texts of 10 tokens
    assert spread_cuts(offsets, 2, 32) == [50]
    assert spread_cuts(offsets, 3, 32) == [34, 67]  # the first texts past 1/3 and 2/3
    assert spread_cuts(offsets, 8, 32) == [34, 67]  # 3 parts of >= 32 texts, not 8
    # By tokens, not texts: the long first half is a part to itself
    offsets = np.concatenate([[0], np.cumsum([30] * 50 + [10] * 50)]).astype(np.int32)
    assert spread_cuts(offsets, 2, 8) == [34]  # 1,020 and 980 of the 2,000 tokens
    # ... but never under `least` texts a part, however long the texts
    offsets = np.concatenate([[0], np.cumsum([1000] * 2 + [1] * 98)]).astype(np.int32)
    assert spread_cuts(offsets, 2, 10) == [10]


def test_no_cut_under_two_parts_or_when_off():
    offsets = np.arange(0, 64, dtype=np.int32)  # 63 texts
    assert spread_cuts(offsets, 2, 32) == []  # not twice 32
    assert spread_cuts(np.arange(0, 65, dtype=np.int32), 2, 32) == [32]
    assert spread_cuts(np.arange(0, 65, dtype=np.int32), 1, 32) == []  # one idle worker
    assert spread_cuts(np.arange(0, 65, dtype=np.int32), 0, 32) == []
    assert spread_cuts(np.arange(0, 65, dtype=np.int32), 2, 0) == []  # 0: never


def test_the_parts_put_back_together_are_the_request():
    enc = encoded([3, 5, 2, 7, 4, 6, 1], pairs=True)
    parts = split(enc, [2, 5])
    assert [p.count for p in parts] == [2, 3, 2]
    assert all(p.offsets[0] == 0 and p.skip == 1 and p.truncated == 0 for p in parts)
    assert np.array_equal(np.concatenate([p.ids for p in parts]), enc.ids)
    assert np.array_equal(np.concatenate([np.diff(p.offsets) for p in parts]),
                          np.diff(enc.offsets))
    assert np.array_equal(np.concatenate([p.segments for p in parts]), enc.segments)
    assert split(encoded([2, 2]), [1])[0].segments is None


def test_a_large_request_runs_on_every_idle_worker_and_its_rows_come_back_in_order(arena):
    before = metrics.SPREAD.labels("spread")._value.get()
    enc = encoded([int(n) for n in np.random.default_rng(0).integers(1, 40, 19)], pairs=True)
    pool = Pool(3)
    outcome = dispatch(pool, arena, enc)
    assert sorted(worker for worker, _ in pool.sent) == [0, 1, 2]  # a part each
    assert sum(texts for _, texts in pool.sent) == enc.count
    assert np.array_equal(outcome.vectors[:, :3], expected_rows(enc))
    # each text's row from the worker that ran its part, the parts in order
    assert outcome.workers == (0, 1, 2)
    assert np.array_equal(outcome.vectors[:, 3], np.repeat([0, 1, 2], [t for _, t in pool.sent]))
    # the timings of the part answered last (worker 2, the slowest fake), every token
    assert outcome.worker == 2 and outcome.result.queue_ms == 2.5
    assert outcome.result.tokens == enc.tokens and outcome.result.batch_size == max(
        texts for _, texts in pool.sent)
    metrics.turn.flush()
    assert metrics.SPREAD.labels("spread")._value.get() == before + 1
    # The parts run at the request's priority (a request that named none is a bulk one, a
    # step below the default already: frontend.tasks.run)
    assert pool.priorities == [0, 0, 0]


def test_parts_run_at_the_requests_priority(arena):
    for priority in (-10, 3):
        pool = Pool(2)
        pool.arena = arena
        cfg = config.load(environ={"SHMSERVE__FRONTENDS__SPREAD_PART_TEXTS": "4"})
        asyncio.run(Dispatcher(cfg, pool, arena).run("m", DIM, encoded([5] * 12), "req",
                                                     time.time() + 5, priority=priority))
        assert pool.priorities == [priority, priority]
    pool = Pool(2)
    outcome = dispatch(pool, arena, encoded([5] * 7))  # not spread: its own priority
    assert outcome.workers == () and pool.priorities == [0]


def whole(why: str) -> float:
    """shmserve_frontend_spread_requests_total's count of large requests run whole for `why`."""
    metrics.turn.flush()
    return metrics.SPREAD.labels(f"whole_for_{why}")._value.get()


def test_busy_workers_are_left_out_and_a_small_request_is_not_spread(arena):
    enc = encoded([5] * 12)
    busy, queries = whole("busy_workers"), whole("queries")
    pool = Pool(2)
    pool.links[1].outstanding = 7  # one idle worker of two: run whole, counted so
    assert dispatch(pool, arena, enc).workers == () and whole("busy_workers") == busy + 1
    pool = Pool(3)
    pool.links[1].outstanding = 7  # this frontend's request in it
    pool.links[2].beat = Heartbeat(3, 2, 102, True, "cpu", (MODEL,), 1, 64, 0.0, 0.0,
                                   queued_tokens=(Queued(0, 40),))  # another frontend's
    outcome = dispatch(pool, arena, enc)
    assert pool.sent == [(0, 12)] and outcome.workers == ()
    assert whole("busy_workers") == busy + 2  # two of three busy
    pool = Pool(3)
    outcome = dispatch(pool, arena, encoded([5] * 7))  # under twice 4 texts
    assert len(pool.sent) == 1 and outcome.workers == ()
    pool = Pool(3)
    outcome = dispatch(pool, arena, enc, part_texts=0)  # off
    assert len(pool.sent) == 1
    assert np.array_equal(outcome.vectors[:, :3], expected_rows(enc))
    # neither is a large request held back
    assert whole("busy_workers") == busy + 2 and whole("queries") == queries


def test_a_smaller_request_lately_keeps_spreading_off_for_the_quiet_time(arena):
    # Interactive traffic beside a bulk client: with a part on every worker, a query waited for
    # a part's pass (an outside check), so spreading waits for spread_quiet_s without one.
    pool = Pool(2)
    pool.arena = arena
    cfg = config.load(environ={"SHMSERVE__FRONTENDS__SPREAD_PART_TEXTS": "4",
                               "SHMSERVE__FRONTENDS__SPREAD_QUIET_S": "0.3"})
    large, query = encoded([5] * 12), encoded([3])

    async def scenario() -> list[tuple[int, ...]]:
        dispatcher = Dispatcher(cfg, pool, arena)
        spread = [(await dispatcher.run("m", DIM, large, "a", time.time() + 5)).workers]
        await dispatcher.run("m", DIM, query, "q", time.time() + 5)
        spread.append((await dispatcher.run("m", DIM, large, "b", time.time() + 5)).workers)
        await asyncio.sleep(0.35)
        spread.append((await dispatcher.run("m", DIM, large, "c", time.time() + 5)).workers)
        return spread

    held = whole("queries")
    assert asyncio.run(scenario()) == [(0, 1), (), (0, 1)]
    assert whole("queries") == held + 1  # b, counted as run whole for the query
    # ... and a larger one does not: a bulk client's own requests keep it spreading (above)


def test_a_query_another_frontend_sent_keeps_spreading_off_too(arena):
    # nginx's least_conn sends queries to the frontends not busy with the bulk client: the one
    # running its requests heard of them only from the workers' heartbeats (an outside check).
    from dataclasses import replace

    pool = Pool(2)
    pool.links[1].beat = replace(pool.links[1].beat, small_at=time.time() - 0.5)
    assert dispatch(pool, arena, encoded([5] * 12)).workers == ()
    pool = Pool(2)
    pool.links[1].beat = replace(pool.links[1].beat, small_at=time.time() - 2.5)
    assert dispatch(pool, arena, encoded([5] * 12)).workers == (0, 1)


def test_parts_that_different_weights_answered_run_again_whole_on_one_worker(arena):
    # A reload committed on one worker before the other: a request never mixes weights
    before = metrics.SPREAD.labels("mixed_revisions")._value.get()
    enc = encoded([5] * 12)
    pool = Pool(2, revisions={1: "r2"})
    outcome = dispatch(pool, arena, enc)
    assert [worker for worker, _ in pool.sent] == [0, 1, 0] and pool.sent[2] == (0, 12)
    assert outcome.workers == () and outcome.revision == "r1"
    assert np.array_equal(outcome.vectors[:, :3], expected_rows(enc))
    metrics.turn.flush()
    assert metrics.SPREAD.labels("mixed_revisions")._value.get() == before + 1


def test_a_parts_failure_is_the_requests_answer(arena):
    pool = Pool(2, fail={1: ErrorCode.OUT_OF_MEMORY})
    with pytest.raises(ApiError) as err:
        dispatch(pool, arena, encoded([5] * 12))
    assert err.value.status == 507 and len(pool.sent) == 2
    assert err.value.worker == 1  # the access line names the worker that failed it


def test_a_failed_part_stops_waiting_for_the_others(arena):
    # Worker 0 answers at once that the part is past its deadline; worker 1's part is
    # abandoned (the worker told to drop it), not waited for.
    pool = Pool(2, fail={0: ErrorCode.DEADLINE})
    with pytest.raises(ApiError) as err:
        dispatch(pool, arena, encoded([5] * 12))
    assert err.value.status == 504 and pool.aborted == [1] and err.value.worker == 0


def test_joined_outcomes_keep_the_slowest_parts_stages():
    from frontend.dispatch import Outcome

    parts = [Outcome(np.zeros((2, 4), np.float32), Result(1, 3.0, 9.0, 2, 10, "r"), 0, 5.0),
             Outcome(np.ones((3, 4), np.float32), Result(2, 1.0, 4.0, 3, 12, "r"), 1, 6.0, 2)]
    outcome = joined(parts)
    assert outcome.vectors.shape == (5, 4) and outcome.vectors[2:].all()
    assert (outcome.worker, outcome.received_at, outcome.attempts) == (1, 6.0, 2)
    assert (outcome.result.queue_ms, outcome.result.inference_ms) == (1.0, 4.0)
    assert (outcome.result.batch_size, outcome.result.tokens) == (3, 22)
