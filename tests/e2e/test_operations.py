"""Operating a running deployment with the CLI: rolling restarts that lose no request, a port
that is taken, commands that find the deployment as it was started."""

import socket
import threading
import time

import pytest
import yaml

from tests.conftest import tiny_overrides
from tests.stack import Stack, free_port


def pid_of(stack: Stack, program: str) -> int:
    out = stack.ctl("pid", program).strip()
    return int(out) if out.isdigit() else 0


class Traffic:
    """Requests through nginx, one after another, from two threads, until stopped; every
    answer's status is kept."""

    def __init__(self, stack: Stack) -> None:
        self.stack, self.statuses, self._stop = stack, [], threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(2)]

    def _run(self, index: int) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                status, _, _ = self.stack.post_json(
                    "/predict", {"texts": [f"rolling restart {index} {n}"]})
            except OSError as exc:  # a refused or reset connection: nginx gave no answer
                status = f"connection: {exc}"
            self.statuses.append(status)
            n += 1

    def __enter__(self) -> "Traffic":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)


@pytest.fixture
def stack(tmp_path, tiny_model):
    s = Stack(tmp_path / "stack", tiny_overrides(
        tiny_model, frontends={"count": 2}, workers={"devices": "cpu", "cpu_workers": 2,
                                                     "torch_threads": 1}))
    s.up()
    yield s
    s.down()


def test_rolling_restarts_answer_every_request(stack):
    programs = ["workers:worker-0", "workers:worker-1", "frontends:frontend-0",
                "frontends:frontend-1"]
    before = {p: pid_of(stack, p) for p in programs}
    nginx_before = pid_of(stack, "nginx")
    with Traffic(stack) as traffic:
        time.sleep(1)
        for group in ("workers", "frontends", "nginx"):
            done = stack.cli("restart", group, timeout=300)
            assert done.returncode == 0, done.stderr
        time.sleep(1)
    after = {p: pid_of(stack, p) for p in programs}
    assert all(after[p] not in (0, before[p]) for p in programs), (before, after)
    assert pid_of(stack, "nginx") == nginx_before  # reloaded in place, not restarted
    failed = [s for s in traffic.statuses if s != 200]
    assert len(traffic.statuses) > 50 and not failed, (len(traffic.statuses), failed[:5])


def test_restart_of_one_program_waits_until_it_is_ready(stack):
    before = pid_of(stack, "workers:worker-1")
    done = stack.cli("restart", "worker-1")
    assert "worker-1 ready" in done.stdout
    status, _, body = stack.get("/ready")
    assert status == 200
    after = pid_of(stack, "workers:worker-1")
    assert after != before
    assert b'"pid": %d' % after in body or b'"pid":%d' % after in body
    unknown = stack.cli("restart", "worker-7", check=False)
    assert unknown.returncode == 2 and "worker-0, worker-1" in unknown.stderr


def test_commands_use_the_config_the_deployment_started_with(stack):
    stack.env["SHMSERVE__SERVER__PORT"] = str(free_port())  # a later shell, other settings
    done = stack.cli("status", check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"127.0.0.1:{stack.port}" in done.stdout


def test_up_fails_fast_when_the_port_is_taken(tmp_path, tiny_model):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        s = Stack(tmp_path / "taken", tiny_overrides(tiny_model))
        s.port = holder.getsockname()[1]
        tree = yaml.safe_load(s.config_file.read_text())
        tree["server"]["port"] = s.port
        s.config_file.write_text(yaml.safe_dump(tree))
        started = time.monotonic()
        done = s.cli("up", "--wait", "--timeout", "60", check=False, timeout=90)
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"127.0.0.1:{s.port} is in use" in done.stderr
        assert time.monotonic() - started < 30
        assert s.cli("status", check=False).returncode == 3  # nothing was started
