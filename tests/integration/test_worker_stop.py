"""How a worker process stops: at once while it loads, after draining once it serves, and with
its last log line written either way (the process skips the interpreter's teardown)."""

import asyncio
import json
import signal
import time

from tests.integration.test_pool import ready_pool, start_patched_worker, start_worker

# The real worker, its model's load made to take a minute (a large checkpoint on a slow disk).
SLOW_LOAD = """
import runpy, sys, time
from gpu_workers import loading

real_load_warm = loading.load_warm

def load_warm(*args):
    print("test.loading", flush=True)
    time.sleep(60)
    return real_load_warm(*args)

loading.load_warm = load_warm
sys.argv = ["gpu_workers", *sys.argv[1:]]
runpy.run_module("gpu_workers", run_name="__main__")
"""


def _stopped_line(log: str) -> dict:
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    stopped = [line for line in lines if line["message"] == "worker.stopped"]
    assert len(stopped) == 1, log[-2000:]
    return stopped[0]


def test_a_worker_stopped_while_loading_exits_at_once(cfg):
    """It went on loading to the end first (a stop or restart waited for the whole load)."""
    worker = start_patched_worker(cfg, SLOW_LOAD)
    log = cfg.run_dir / "worker.log"
    try:
        deadline = time.monotonic() + 60
        while "test.loading" not in log.read_text():
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(15) == 0
    finally:
        worker.kill()
        worker.wait()
    assert _stopped_line(log.read_text())["while_loading"] is True


def test_a_serving_worker_stops_cleanly_and_logs_it_last(cfg):
    worker = start_worker(cfg)
    try:
        async def wait_ready():
            pool = await ready_pool(cfg)
            await pool.close()
        asyncio.run(wait_ready())
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
    finally:
        worker.kill()
        worker.wait()
    log = (cfg.run_dir / "worker.log").read_text()
    assert _stopped_line(log)["while_loading"] is False
    assert "Traceback" not in log, log[-2000:]
