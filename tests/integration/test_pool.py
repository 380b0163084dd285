"""The frontend's worker client against a real worker subprocess (no nginx, no supervisord)."""

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from frontend.dispatch import Dispatcher
from frontend.errors import ApiError
from frontend.links import WorkerGone
from frontend.pool import WorkerPool
from frontend.tokenizer import Encoded
from shmserve import arena as shm
from shmserve import topology
from shmserve.protocol import Error, ErrorCode, Result, Submit
from tests.stack import REPO


def start_worker(cfg):
    with (cfg.run_dir / "worker.log").open("ab") as log:
        return subprocess.Popen([sys.executable, "-m", "gpu_workers", "--config",
                                 str(cfg.run_dir / "config.json"), "--index", "0"], cwd=REPO,
                                env={**os.environ, "OMP_NUM_THREADS": "1"},
                                stdout=log, stderr=subprocess.STDOUT)


def run(scenario, worker, arena=None) -> None:
    try:
        asyncio.run(scenario())
    finally:
        worker.kill()
        worker.wait()
        if arena is not None:
            arena.close()


def submit_rows(pool, arena, request_id: str, n: int) -> asyncio.Future:
    """A request of `n` texts of 40 tokens to the worker `pick` chooses."""
    return pool.submit(pool.pick("tiny"), Submit(
        pool.next_seq(), request_id, "tiny", *_slot(arena, n, 32), time.time() + 30, 0,
        arena.handle(0, "int32", (0,))), n, lambda: None)


def encoded(n_texts: int, length: int) -> Encoded:
    ids = np.full(n_texts * length, 1000, np.int32)
    ids[::length] = 101
    return Encoded(ids, np.arange(0, n_texts * length + 1, length, dtype=np.int32), 0)


@contextlib.asynccontextmanager
async def dispatching(cfg, arena):
    """A ready pool's Dispatcher over `arena`, as a frontend has them; the pool closed after."""
    pool = await ready_pool(cfg)
    try:
        yield Dispatcher(cfg, pool, arena)
    finally:
        await pool.close()


async def long_beside_short(dispatcher, deadline: float) -> list:
    """A request of one 30-token text and one of three 5-token texts, submitted in one loop turn
    (one pass): their outcomes, a Result's Outcome or the ApiError raised."""
    return await asyncio.gather(
        dispatcher.run("tiny", 32, encoded(1, 30), "long", deadline),
        dispatcher.run("tiny", 32, encoded(3, 5), "short", deadline), return_exceptions=True)


def frontend_arena(cfg) -> shm.Arena:
    return shm.Arena(shm.arena_name(topology.instance_id(cfg), "fe0"), 1 << 22)


async def ready_pool(cfg, timeout=60.0) -> WorkerPool:
    pool = WorkerPool(cfg)
    await pool.start()
    if await pool.wait_for_worker("tiny", timeout) is None:
        await pool.close()
        raise AssertionError("worker never became ready")
    return pool


def test_round_trip_deadline_and_kill(cfg):
    worker = start_worker(cfg)
    arena = shm.Arena(shm.arena_name(topology.instance_id(cfg), "fe0"), 1 << 22)

    async def scenario():
        pool = await ready_pool(cfg)
        dispatcher = Dispatcher(cfg, pool, arena)
        try:
            out = await dispatcher.run("tiny", 32, encoded(3, 5), "r1", time.time() + 10)
            assert out.vectors.shape == (3, 32) and isinstance(out.result, Result)
            np.testing.assert_allclose(np.linalg.norm(out.vectors, axis=1), 1, atol=1e-5)
            assert arena.bytes_used == 0  # the slot went back once the worker answered

            # A deadline already passed: the worker drops it before inference.
            with pytest.raises(ApiError) as info:
                await dispatcher.run("tiny", 32, encoded(1, 5), "r2", time.time() - 1)
            assert info.value.status == 504

            # Unknown model at the worker: a per-request error, the worker lives on.
            link = pool.pick("tiny")
            seq = pool.next_seq()
            handle = arena.handle(arena.alloc(64), "int32", (2,))
            settled = []
            empty = arena.handle(handle.offset, "int32", (0,))
            reply = await pool.submit(link, Submit(seq, "r3", "nope", handle, handle, handle,
                                                   time.time() + 5, 0, empty), 1,
                                      lambda: settled.append(1))
            assert isinstance(reply, Error) and reply.code is ErrorCode.UNKNOWN_MODEL
            assert settled == [1]
            arena.free(handle.offset)

            # Offsets that go backwards (a frontend's bug, or memory changed under it): refused
            # as that request's error; the worker lives on.
            ids, offsets, out = _slot(arena, 3, 32)
            arena.view(offsets)[:] = [0, 40, 20, 120]
            reply = await pool.submit(link, Submit(pool.next_seq(), "r4", "tiny", ids, offsets,
                                                   out, time.time() + 5, 0, empty), 3,
                                      lambda: None)
            assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID
            assert "disagree" in reply.message
            assert isinstance(await submit_rows(pool, arena, "r5", 2), Result)

            # Output rows of another width than the model's: a pass wrote 32-wide rows into
            # 16-wide ones ("could not broadcast") and the worker died with every request of it.
            with pytest.raises(ApiError) as info:
                await dispatcher.run("tiny", 16, encoded(2, 5), "narrow", time.time() + 10)
            assert "the model's rows are 32 wide" in info.value.message
            assert isinstance(await submit_rows(pool, arena, "r6", 2), Result)

            # SIGKILL: pending requests fail with WorkerGone within the heartbeat timeout.
            futures = [submit_rows(pool, arena, f"k{i}", 64) for i in range(4)]
            worker.send_signal(signal.SIGKILL)
            started = time.monotonic()
            results = await asyncio.gather(*futures, return_exceptions=True)
            waited = time.monotonic() - started
            assert waited < cfg.workers.heartbeat_timeout_s + 2
            # Some may have finished before the kill; none hangs, the rest report the loss.
            assert all(isinstance(r, (Result, WorkerGone)) for r in results), results
            assert pool.pick("tiny") is None
        finally:
            await pool.close()

    run(scenario, worker, arena)


def _slot(arena, n, dim):
    length = 40
    off = arena.alloc(4 * (n + 1) + 64 + 4 * n * length + 64 + 4 * n * dim)
    offsets = arena.handle(off, "int32", (n + 1,))
    ids_off = off + -(-4 * (n + 1) // 64) * 64
    ids = arena.handle(ids_off, "int32", (n * length,))
    out = arena.handle(ids_off + -(-4 * n * length // 64) * 64, "float32", (n, dim))
    arena.view(offsets)[:] = np.arange(0, n * length + 1, length)
    arena.view(ids)[:] = 1000
    return ids, offsets, out


def test_restarted_worker_is_taken_back(cfg):
    worker = start_worker(cfg)

    async def scenario():
        pool = await ready_pool(cfg)
        try:
            first_pid = pool.links[0].beat.pid
            worker.send_signal(signal.SIGKILL)
            worker.wait()
            replacement = start_worker(cfg)
            try:
                deadline = time.monotonic() + 60
                link = pool.links[0]
                while not (link.ready and link.beat.pid == replacement.pid):
                    assert time.monotonic() < deadline, "replacement never became ready"
                    await asyncio.sleep(0.05)
                assert replacement.pid != first_pid
                assert pool.pick("tiny") is link
            finally:
                replacement.send_signal(signal.SIGTERM)
                assert replacement.wait(30) == 0  # graceful stop exits 0
        finally:
            await pool.close()

    run(scenario, worker)


def test_a_silent_worker_keeps_its_slots_until_it_answers_or_is_gone(cfg):
    """A worker silent past the heartbeat timeout (stopped, swapped out) has its requests
    failed over, but it may resume and still read their token ids and write their rows: their
    slots are not given to other requests until it answers (the aborts sent meanwhile) or its
    process is gone. Before, they were freed at once and reused, and the resumed worker read
    another request's offsets (it crashed) or could have written into its rows."""
    worker = start_worker(cfg)
    arena = shm.Arena(shm.arena_name(topology.instance_id(cfg), "fe0"), 1 << 24)

    async def submit_silent(pool, prefix):
        link, settled = pool.pick("tiny"), []
        futures = [pool.submit(link, Submit(pool.next_seq(), f"{prefix}{i}", "tiny",
                                            *_slot(arena, 4, 32), time.time() + 30, 0,
                                            arena.handle(0, "int32", (0,))), 4,
                               lambda: settled.append(1)) for i in range(3)]
        results = await asyncio.gather(*futures, return_exceptions=True)
        assert all(isinstance(r, WorkerGone) for r in results), results
        return link, settled

    async def until(condition, seconds, what):
        deadline = time.monotonic() + seconds
        while not condition():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.05)

    async def scenario():
        pool = await ready_pool(cfg)
        try:
            # Stopped, then resumed: the slots stay held while it is silent, and go back once
            # it answers the aborts it finds on resuming; it serves on, alive.
            worker.send_signal(signal.SIGSTOP)
            link, settled = await submit_silent(pool, "s")
            await asyncio.sleep(1.0)
            assert settled == [] and len(link.held) == 3 and arena.bytes_used > 0
            worker.send_signal(signal.SIGCONT)
            await until(lambda: len(settled) == 3, 20, "the resumed worker never answered")
            assert not link.held and worker.poll() is None
            await until(lambda: pool.pick("tiny") is not None, 20, "never routable again")
            assert isinstance(await submit_rows(pool, arena, "after", 2), Result)
            # Stopped, then killed: released once its process is gone.
            worker.send_signal(signal.SIGSTOP)
            link, settled = await submit_silent(pool, "k")
            assert settled == []
            worker.send_signal(signal.SIGKILL)
            worker.wait()
            await until(lambda: len(settled) == 3, 10, "slots of a dead worker still held")
            assert not link.held
        finally:
            await pool.close()

    run(scenario, worker, arena)


def test_a_killed_worker_is_unroutable_at_once_and_a_drained_one_answers(cfg):
    """The socket monitor: a dropped connection takes the worker out of routing (and /ready)
    in well under `heartbeat_timeout_s`, heartbeats it sent before dying do not bring it back,
    and a worker that drains on SIGTERM still gets its answers through."""
    worker = start_worker(cfg)
    arena = shm.Arena(shm.arena_name(topology.instance_id(cfg), "fe0"), 1 << 24)
    slow_cfg = dataclasses.replace(cfg, workers=dataclasses.replace(cfg.workers,
                                                                    heartbeat_timeout_s=30))

    async def scenario():
        pool = await ready_pool(slow_cfg)
        try:
            worker.send_signal(signal.SIGKILL)
            started = time.monotonic()
            while pool.pick("tiny") is not None:
                assert time.monotonic() - started < 2, "still routed to a killed worker"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # pings keep going out; nothing stale revives it
            assert pool.pick("tiny") is None and not pool.all_ready

            drained = start_worker(cfg)
            try:
                assert await pool.wait_for_worker("tiny", 60) is not None
                futures = [submit_rows(pool, arena, f"d{i}", 32) for i in range(8)]
                await asyncio.sleep(0.05)  # the submits leave with this loop turn
                drained.send_signal(signal.SIGTERM)
                results = await asyncio.gather(*futures, return_exceptions=True)
                assert all(isinstance(r, Result) for r in results), results
                assert drained.wait(30) == 0
            finally:
                drained.kill()
                drained.wait()
        finally:
            await pool.close()

    run(scenario, worker, arena)


# A worker whose device holds at most 20 padded tokens a pass once warmed up: the real worker
# process, its model's forward patched to fail the way torch does on a GPU.
SMALL_DEVICE = """
import os, runpy, sys, torch
from gpu_workers import model

real_forward, real_warm_up = model.Model.forward_groups, model.warm_up
warming = False

def forward_groups(self, groups):
    padded = sum(ids.shape[0] * ids.shape[1] for ids, _, _ in groups)
    if padded > 20 and not (warming and os.environ.get("WARM_UP_FITS") == "1"):
        raise torch.OutOfMemoryError(f"CUDA out of memory: {padded} tokens (test)")
    return real_forward(self, groups)

def warm_up(*args):
    global warming
    warming = True
    speed = real_warm_up(*args)
    warming = False
    return speed

model.Model.forward_groups, model.warm_up = forward_groups, warm_up
sys.argv = ["gpu_workers", *sys.argv[1:]]
runpy.run_module("gpu_workers", run_name="__main__")
"""


def start_patched_worker(cfg, script: str, **env: str) -> subprocess.Popen:
    """Worker 0 of `cfg` run through `script` (which patches the model, then runs the worker)."""
    with (cfg.run_dir / "worker.log").open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-c", script, "--config", str(cfg.run_dir / "config.json"),
             "--index", "0"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def start_small_device_worker(cfg, warm_up_fits: bool) -> subprocess.Popen:
    return start_patched_worker(cfg, SMALL_DEVICE, WARM_UP_FITS=str(int(warm_up_fits)))


def test_limits_too_large_for_the_device_stop_the_worker_with_a_clear_error(cfg):
    worker = start_small_device_worker(cfg, warm_up_fits=False)
    try:
        assert worker.wait(60) != 0
    finally:
        worker.kill()
    logged = (cfg.run_dir / "worker.log").read_text()
    assert "ran out of device memory in warm-up (max_batch_size" in logged
    assert "lower them" in logged


def test_a_pass_out_of_memory_is_retried_in_halves_and_only_a_text_too_large_fails(cfg):
    worker = start_small_device_worker(cfg, warm_up_fits=True)
    arena = frontend_arena(cfg)

    async def scenario():
        async with dispatching(cfg, arena) as dispatcher:
            deadline = time.time() + 20
            one = await dispatcher.run("tiny", 32, encoded(1, 5), "one", deadline)
            # 8 texts of 5 tokens: 40 padded tokens do not fit; halves of 4 (20) do.
            many = await dispatcher.run("tiny", 32, encoded(8, 5), "many", deadline)
            assert many.vectors.shape == (8, 32)
            np.testing.assert_allclose(many.vectors, np.repeat(one.vectors, 8, axis=0),
                                       atol=1e-5)
            # A text of 30 tokens cannot run even alone; the request beside it, in the same
            # pass, is answered.
            big, small = await long_beside_short(dispatcher, deadline)
            assert isinstance(big, ApiError) and big.status == 507, big
            assert "out of memory" in big.message and "30 tokens" in big.message
            np.testing.assert_allclose(small.vectors, np.repeat(one.vectors, 3, axis=0),
                                       atol=1e-5)
            assert worker.poll() is None  # the worker lives on and serves
            again = await dispatcher.run("tiny", 32, encoded(2, 5), "again", deadline)
            assert again.vectors.shape == (2, 32)

    run(scenario, worker, arena)
    logged = (cfg.run_dir / "worker.log").read_text()
    assert '"forward.out_of_memory"' in logged or "forward.out_of_memory" in logged


# A worker whose model answers NaN for every text of 30 tokens (after warm-up): the real worker
# process, its forward patched, as an fp16 overflow on one input would do.
NAN_ON_30 = """
import runpy, sys
import numpy as np
from gpu_workers import model

real_forward = model.Model.forward_groups

def forward_groups(self, groups, tokens=False):
    out = np.array(real_forward(self, groups, tokens))
    lengths = np.concatenate([lens for _, lens, _ in groups])
    if tokens:  # a row a token: each text's rows
        lengths = np.repeat(lengths, lengths)
    out[lengths == 30] = np.nan
    return out

model.Model.forward_groups = forward_groups
sys.argv = ["gpu_workers", *sys.argv[1:]]
runpy.run_module("gpu_workers", run_name="__main__")
"""


def test_a_text_whose_output_is_not_finite_fails_alone_with_500(cfg):
    """It was answered: NaN rows, which JSON renders as nulls, with status 200."""
    worker = start_patched_worker(cfg, NAN_ON_30)
    arena = frontend_arena(cfg)

    async def scenario():
        async with dispatching(cfg, arena) as dispatcher:
            deadline = time.time() + 20
            bad, good = await long_beside_short(dispatcher, deadline)
            assert isinstance(bad, ApiError) and bad.status == 500, bad
            assert "NaN or infinity" in bad.message and "30 tokens" in bad.message
            assert good.vectors.shape == (3, 32) and np.isfinite(good.vectors).all()
            # The same with a row a token (TEI's /embed_all): the text's rows, not one row.
            bad, good = await asyncio.gather(
                dispatcher.run("tiny", 32, encoded(1, 30), "long", deadline, per_token=True),
                dispatcher.run("tiny", 32, encoded(3, 5), "short", deadline, per_token=True),
                return_exceptions=True)
            assert isinstance(bad, ApiError) and bad.status == 500, bad
            assert good.vectors.shape == (15, 32) and np.isfinite(good.vectors).all()
            assert worker.poll() is None

    run(scenario, worker, arena)
    assert "forward.non_finite" in (cfg.run_dir / "worker.log").read_text()


def test_a_pass_mixing_pairs_and_single_texts_gives_each_its_own_rows(cfg):
    """A classifier's requests may be pairs (TEI's /predict) or texts, and one pass may hold
    both: a text alone is one segment, a pair two, whichever request comes first in the pass
    (the worker once read the kind of the pass from its first text only)."""
    worker = start_worker(cfg)
    arena = frontend_arena(cfg)
    pair = dataclasses.replace(encoded(2, 6), segments=np.array([3, 2], np.int32))
    single = encoded(2, 6)

    async def scenario():
        async with dispatching(cfg, arena) as dispatcher:
            def send(enc, name):
                return dispatcher.run("tiny", 32, enc, name, time.time() + 10)

            alone_pair = (await send(pair, "p")).vectors
            alone_single = (await send(single, "s")).vectors
            assert not np.allclose(alone_pair, alone_single)  # token types change the rows
            for first, second in ((pair, single), (single, pair)):
                # Submitted in one loop turn: one message, queued before the next pass.
                a, b = await asyncio.gather(send(first, "a"), send(second, "b"))
                assert a.result.batch_size == b.result.batch_size == 4  # one pass
                got = {id(first): a.vectors, id(second): b.vectors}
                np.testing.assert_allclose(got[id(pair)], alone_pair, atol=1e-5)
                np.testing.assert_allclose(got[id(single)], alone_single, atol=1e-5)

    run(scenario, worker, arena)
