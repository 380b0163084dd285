"""What a worker's socket thread knows of the frontends' processes (gpu_workers.intake)."""

import os
import subprocess
import sys
import time

from gpu_workers.intake import running


def test_a_killed_process_is_not_running_even_before_it_is_reaped():
    """A frontend killed is a zombie until supervisord reaps it: its queued requests are let
    go from then, not from the reaping."""
    assert running(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert running(child.pid)
        child.kill()
        deadline = time.monotonic() + 10
        while running(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not running(child.pid)
        assert child.poll() is not None  # reaped only now: it was a zombie above
    finally:
        child.kill()
        child.wait()
    assert not running(child.pid)  # gone


def test_a_process_this_worker_cannot_see_is_not_taken_for_running():
    # (another pid namespace, or no /proc): then judged by pings alone (Intake.heartbeat)
    assert not running(2**22 + 12345)
