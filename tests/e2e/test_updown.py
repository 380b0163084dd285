"""Bringing a deployment up and down with the CLI, each test its own stack: a port that is
taken, an `up` during a `down`, a run directory with a space and a letter beyond ASCII, a
`down` right after an `up`."""

import json
import os
import re
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

import yaml

from shmserve import config
from tests.conftest import tiny_overrides
from tests.stack import Stack


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
        assert f"127.0.0.1:{s.port} is in use by another process (pid {os.getpid()}, " \
            in done.stderr, done.stderr  # who holds it, named
        assert time.monotonic() - started < 30
        assert not s.run_dir.exists()  # refused before it wrote anything
        assert s.cli("status", check=False).returncode == 3  # nothing was started


def test_up_during_a_down_says_so_and_harms_nothing(tmp_path, tiny_model):
    """`up` while a `down` stopped the programs said "already running ... `shmserve apply`
    takes the config" (an outside check). A stopped worker holds the `down` for its stop wait."""
    import subprocess
    import sys

    from shmserve import processes

    stack = Stack(tmp_path / "t", tiny_overrides(tiny_model, frontends={"count": 1},
                                                 server={"drain_timeout_s": 1}))
    stack.up()
    cfg = config.load_resolved(stack.run_dir / "config.json")
    worker = stack.pid("workers:worker-0")
    os.kill(worker, signal.SIGSTOP)  # supervisord's SIGTERM waits; its SIGKILL ends it
    down = subprocess.Popen([sys.executable, "-m", "shmserve.cli", "down", "--config",
                             str(stack.config_file)], env=stack.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        stack.wait_until(lambda: processes.shutting_down(cfg), 30, "supervisord shutting down")
        again = stack.cli("up", check=False)
        assert again.returncode == 2, again.stderr
        assert "a `down` is stopping this deployment" in again.stderr, again.stderr
        assert "apply" not in again.stderr
        out, err = down.communicate(timeout=120)
        assert down.returncode == 0, err
        assert processes.orphans(cfg) == [] and not processes.alive(worker)
        stack.up()  # once it has finished
        assert stack.post_json("/v1/embeddings", {"input": ["x"]})[0] == 200
    finally:
        if down.poll() is None:
            down.kill()
        stack.down()


def test_a_run_directory_with_a_space_and_a_letter_beyond_ascii_serves(tiny_model):
    """A checkout in "my models" or "modèles" could not start with the default config (its
    run directory inside it was refused, written unquoted into nginx.conf: an outside check).
    Under /tmp, not tmp_path: a fresh CI's tmp_path left no room for the socket paths."""
    base = Path(tempfile.mkdtemp(prefix="shm "))
    stack = Stack(base / "my models é", tiny_overrides(tiny_model, frontends={"count": 1}))
    try:
        stack.up()
        try:
            assert stack.post_json("/v1/embeddings", {"input": ["x"]})[0] == 200
            assert json.loads(stack.cli("status", "--json").stdout)["state"] == "ready"
            assert "reloaded its configuration" in stack.cli("restart", "nginx").stdout
            assert stack.post_json("/v1/embeddings", {"input": ["y"]})[0] == 200
        finally:
            stack.down()
        assert not (stack.run_dir / "supervisord.pid").exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_down_right_after_an_up_stops_every_program_by_its_signal(tmp_path, tiny_model):
    """A stop signal supervisord sent a program not yet exec'd was lost: nginx, spawned 2 ms
    before a `down`, was SIGKILLed after its stop wait (17 s; an outside check). `down` now
    lets the spawns settle first. Delivered, the signal stops nginx gracefully, or, where its
    launcher (shmserve.nginxrun) is still starting Python and has no handler yet (a loaded
    machine: 2.4 s after its spawn in a fresh-clone CI run), by the signal's default action."""
    stack = Stack(tmp_path / "t", tiny_overrides(tiny_model, frontends={"count": 1}))
    try:
        stack.cli("up")  # no --wait: the programs are spawning as it returns
    finally:
        started = time.monotonic()
        stack.down()
        took = time.monotonic() - started
    log = (stack.run_dir / "logs" / "supervisord.log").read_text()
    assert "spawned: 'nginx'" in log, log
    assert re.search(r"stopped: nginx \((exit status 0|terminated by SIGQUIT)\)", log), log
    assert "SIGKILL" not in log, log
    assert took < 12, f"down took {took:.1f} s (nginx's stop wait is 15 s)\n{log}"
