"""A frontend's tasks outlive a failure in one message or one heartbeat round (an outside
check: out of descriptors, a handler raised, which ended the worker's receive task, so a
restarted worker stayed unseen, and the heartbeat task, so the workers SIGKILLed both
frontends for silence)."""

import asyncio
import time

from frontend.pool import WorkerPool
from shmserve import arena as shm
from shmserve import topology
from shmserve.protocol import Result
from tests.integration.test_pool import ready_pool, run, start_worker, submit_rows


def test_a_failing_message_and_round_leave_the_tasks_running(cfg, monkeypatch):
    worker = start_worker(cfg)
    arena = shm.Arena(shm.arena_name(topology.instance_id(cfg), "fe0"), 1 << 22)
    failures = {"beat": 0, "round": 0}
    on_heartbeat, round_ = WorkerPool._on_heartbeat, WorkerPool._round

    def failing_heartbeat(self, link, msg):
        if failures["beat"] < 3:
            failures["beat"] += 1
            raise OSError(24, "Too many open files")
        return on_heartbeat(self, link, msg)

    def failing_round(self, now):
        if failures["round"] < 2:
            failures["round"] += 1
            raise OSError(24, "Too many open files")
        return round_(self, now)

    async def scenario():
        pool = await ready_pool(cfg)
        try:
            link = pool.links[0]
            monkeypatch.setattr(WorkerPool, "_on_heartbeat", failing_heartbeat)
            monkeypatch.setattr(WorkerPool, "_round", failing_round)
            deadline = time.monotonic() + 20
            while min(failures.values()) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert failures["beat"] >= 2 and failures["round"] == 2, failures
            # The receive task still settles replies, and heartbeats are heard again.
            assert isinstance(await submit_rows(pool, arena, "after", 2), Result)
            heard = link.last_beat
            while link.last_beat == heard and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert link.last_beat > heard and link.alive
            assert all(not task.done() for task in pool._tasks), pool._tasks
        finally:
            await pool.close()

    run(scenario, worker, arena)
