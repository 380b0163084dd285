"""A frontend killed with requests queued at a worker: ZeroMQ tells the worker its connection
closed, and the worker drops what it had queued (no one can be answered: its socket, shared
memory and clients are gone) at once, off the queue bound too, so the clients' retries through
nginx are neither refused for that queue nor computed behind it."""

import asyncio
import json
import signal
import subprocess
import sys
import time

import pytest

from frontend.dispatch import Dispatcher
from frontend.pool import WorkerPool
from shmserve import arena as shm
from shmserve import topology
from tests.conftest import tiny_overrides
from tests.integration.conftest import run_config
from tests.integration.test_pool import encoded, start_patched_worker
from tests.stack import REPO

# The real worker, each pass made to take 0.5 s: a backlog of seconds from a few requests.
SLOW_PASS = """
import runpy, sys, time
from gpu_workers import model

real_forward = model.Model.forward_groups
warm = [True]

def forward_groups(self, groups, *args, **kwargs):
    if not warm[0]:
        time.sleep(0.5)
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

# Frontend 0 fills the worker's queue (4 requests of 16 texts: workers.queue_texts 64, a pass
# each: ~2 s of work), then waits; the test kills it with SIGKILL, as a crash would.
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
                                                   time.time() + 30)) for i in range(4)]
    await asyncio.sleep(0.3)
    print("queued", flush=True)
    await asyncio.gather(*queued)

asyncio.run(main())
"""


@pytest.fixture
def cfg(tmp_path, tiny_model):
    return run_config(tmp_path, tiny_overrides(tiny_model, workers={"queue_texts": 64},
                                               limits={"max_texts_per_request": 16}))


def test_a_killed_frontends_queued_requests_are_dropped_at_once(cfg):
    worker = start_patched_worker(cfg, SLOW_PASS)
    new_arena = shm.Arena(shm.arena_name(topology.instance_id(cfg), "fe1"), 1 << 22)
    old = subprocess.Popen([sys.executable, "-c", OLD_FRONTEND, str(cfg.run_dir / "config.json")],
                           cwd=REPO, stdout=subprocess.PIPE, text=True)

    async def scenario():
        # The other frontend (1), already connected, as nginx's retries find it.
        other = WorkerPool(cfg, frontend=1)
        await other.start()
        try:
            assert await other.wait_for_worker("tiny", 30) is not None
            assert await asyncio.to_thread(old.stdout.readline) == "queued\n"
            old.kill()  # its socket, arena and clients gone; its 64 texts still queued
            await asyncio.to_thread(old.wait)
            await asyncio.sleep(0.1)  # nginx's retry: tens of milliseconds later
            started = time.monotonic()
            # A full request: refused 429 (queue full) if the dead one's texts still counted.
            out = await Dispatcher(cfg, other, new_arena).run(
                "tiny", 32, encoded(16, 8), "retry", time.time() + 30)
            assert out.vectors.shape == (16, 32)
            return time.monotonic() - started
        finally:
            await other.close()

    try:
        waited = asyncio.run(scenario())
    finally:
        old.kill()
        old.wait()
        old.stdout.close()
        # A killed frontend leaves its arena file (a deployment's sweep removes it; here
        # nothing would: a 4 MiB file after every suite run, traced by its pid)
        for left in shm.SHM_DIR.glob(f"shmserve-{topology.instance_id(cfg)}-fe0-{old.pid}-*"):
            left.unlink(missing_ok=True)
        worker.send_signal(signal.SIGTERM)  # a stop flushes its log (a kill loses the last lines)
        try:
            worker.wait(30)
        finally:
            worker.kill()
            worker.wait()
        new_arena.close()
    lines = [json.loads(line) for line in (cfg.run_dir / "worker.log").read_text().splitlines()
             if line.startswith("{") and "worker.frontend_gone" in line]
    assert len(lines) == 1 and lines[0]["frontend"] == 0, lines
    # The request in the pass running then finishes it; the rest never runs, and the retry
    # waits for that pass and its own, not the ~1.5 s left of the dead frontend's queue.
    assert lines[0]["orphaned_requests"] >= 3, lines
    assert waited < 1.4, waited
