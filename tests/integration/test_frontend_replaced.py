"""A frontend killed with requests queued at a worker: the process supervisord starts in its
place pings with another socket, and the worker drops what the old one queued (no one can be
answered: its socket, shared memory and clients are gone) instead of computing it first."""

import asyncio
import json
import signal
import subprocess
import sys
import time

from frontend.dispatch import Dispatcher
from frontend.pool import WorkerPool
from shmserve import arena as shm
from shmserve import topology
from tests.integration.test_pool import encoded, start_patched_worker
from tests.stack import REPO

# The real worker, each pass made to take 0.3 s: a backlog of seconds from a few requests.
SLOW_PASS = """
import runpy, sys, time
from gpu_workers import model

real_forward = model.Model.forward_groups
warm = [True]

def forward_groups(self, groups, *args, **kwargs):
    if not warm[0]:
        time.sleep(0.3)
    return real_forward(self, groups, *args, **kwargs)

real_warm_up = model.warm_up

def warm_up(*args):
    speed = real_warm_up(*args)
    warm[0] = False
    return speed

model.Model.forward_groups, model.warm_up = forward_groups, warm_up
sys.argv = ["gpu_workers", *sys.argv[1:]]
runpy.run_module("gpu_workers", run_name="__main__")
"""


# Frontend 0 with 12 requests of 16 texts queued at the worker (a pass each, max_batch_size
# 16: ~3.6 s of backlog), then waiting; the test kills it with SIGKILL, as a crash would.
OLD_FRONTEND = """
import asyncio, sys, time
from frontend.dispatch import Dispatcher
from shmserve import arena as shm, config, topology
from tests.integration.test_pool import encoded, ready_pool

async def main():
    cfg = config.load_resolved(sys.argv[1])
    arena = shm.Arena(shm.arena_name(topology.instance_id(cfg), "fe0"), 1 << 22)
    pool = await ready_pool(cfg)
    dispatcher = Dispatcher(cfg, pool, arena)
    queued = [asyncio.ensure_future(dispatcher.run("tiny", 32, encoded(16, 8), f"old-{i}",
                                                   time.time() + 30)) for i in range(12)]
    await asyncio.sleep(0.3)
    print("queued", flush=True)
    await asyncio.gather(*queued)

asyncio.run(main())
"""


def test_a_replaced_frontends_queued_requests_are_dropped_not_computed(cfg):
    worker = start_patched_worker(cfg, SLOW_PASS)
    new_arena = shm.Arena(shm.arena_name(topology.instance_id(cfg), "fe0-new"), 1 << 22)
    old = subprocess.Popen([sys.executable, "-c", OLD_FRONTEND, str(cfg.run_dir / "config.json")],
                           cwd=REPO, stdout=subprocess.PIPE, text=True)

    async def scenario():
        assert old.stdout.readline().strip() == "queued"
        old.kill()  # its socket, arena and clients gone; its requests still queued
        old.wait()
        new = WorkerPool(cfg, frontend=0)  # supervisord's replacement, frontend 0 again
        await new.start()
        try:
            assert await new.wait_for_worker("tiny", 10) is not None
            started = time.monotonic()
            out = await Dispatcher(cfg, new, new_arena).run(
                "tiny", 32, encoded(2, 8), "new", time.time() + 30)
            waited = time.monotonic() - started
            assert out.vectors.shape == (2, 32)
        finally:
            await new.close()
        return waited

    try:
        waited = asyncio.run(scenario())
    finally:
        old.kill()
        old.wait()
        old.stdout.close()
        worker.send_signal(signal.SIGTERM)  # a stop flushes its log (a kill loses the last lines)
        try:
            worker.wait(30)
        finally:
            worker.kill()
            worker.wait()
        new_arena.close()
    lines = [json.loads(line) for line in (cfg.run_dir / "worker.log").read_text().splitlines()
             if line.startswith("{") and "worker.frontend_replaced" in line]
    assert len(lines) == 1 and lines[0]["frontend"] == 0
    # The passes running or formed when the new socket pinged finish; the rest is dropped,
    # and the new frontend's request does not wait behind it.
    assert lines[0]["dropped_requests"] >= 8, lines
    assert waited < 2.5, waited  # the old backlog had ~3 s left
