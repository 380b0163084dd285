"""`logging.stdout` in a container's `up --foreground`: every program's lines on one stdout,
each whole (its own stack: tests/e2e/test_observability.py's is shared by that module)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from shmserve.config import REPO_ROOT
from tests.conftest import tiny_overrides
from tests.e2e.test_observability import send
from tests.stack import Stack


def test_logging_stdout_puts_every_programs_lines_on_the_foreground_stdout(tmp_path,
                                                                          tiny_model):
    """A container's `up --foreground` with logging.stdout: nginx's, the frontends' and the
    workers' lines reach its stdout (only supervisord's did: `kubectl logs` showed nothing of
    the requests, an outside check), each line whole, and SIGTERM stops it all."""
    import time

    stack = Stack(tmp_path, tiny_overrides(tiny_model, frontends={"count": 2},
                                           logging={"stdout": True, "format": "json"}))
    out = (tmp_path / "stdout.txt").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "shmserve.cli", "up", "--foreground",
                             "--config", str(stack.config_file)], cwd=REPO_ROOT,
                            env=stack.env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 150
        while True:
            try:
                if stack.get("/ready")[0] == 200:
                    break
            except OSError:  # nginx not listening yet
                pass
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "stdout.txt").read_text()
            time.sleep(0.5)
        answers = send(stack, [("/v1/embeddings", {"input": f"text {i}"}, f"stdout-{i}")
                               for i in range(40)])
        assert [status for status, _, _ in answers] == [200] * 40
        time.sleep(1.0)  # the programs' buffered lines (logging.flush_interval_ms: 200)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        out.close()
    lines = (tmp_path / "stdout.txt").read_bytes().decode().splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]  # each one whole
    for i in range(40):
        on = [r for r in records if r.get("request_id") == f"stdout-{i}"
              or f"stdout-{i}" in r.get("request_ids", ())]
        kinds = {"nginx" if "upstream_status" in r or "remote_addr" in r
                 else r.get("process", "?").split("-")[0] for r in on}
        assert {"nginx", "frontend", "worker"} <= kinds, (i, on)
    assert not (stack.run_dir / "logs" / "frontend-0.log").exists()
