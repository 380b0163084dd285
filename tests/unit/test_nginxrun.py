"""The nginx launcher: finding and killing the nginx processes a SIGKILLed master left behind."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from shmserve import nginxrun, render, supervisor_files
from tests.unit.test_render import make_config, wait_until


def fake_process(proc: Path, pid: int, comm: str, *open_files: str) -> None:
    (proc / str(pid) / "fd").mkdir(parents=True)
    (proc / str(pid) / "comm").write_text(comm + "\n")
    for fd, target in enumerate(["/dev/null", *open_files]):
        (proc / str(pid) / "fd" / str(fd)).symlink_to(target)


def test_find_matches_nginx_processes_holding_the_conf(tmp_path):
    proc, conf = tmp_path / "proc", "/run/x/nginx/nginx.conf"
    fake_process(proc, 10, "nginx", conf)
    fake_process(proc, 11, "nginx", "socket:[123]", conf + " (deleted)")  # after a re-render
    fake_process(proc, 12, "nginx", "/run/other/nginx/nginx.conf")  # another deployment
    fake_process(proc, 13, "python", conf)  # someone reading the file
    fake_process(proc, 14, "nginx")
    (proc / "self").mkdir()
    (proc / "15").mkdir()  # a process that exited while we looked
    assert nginxrun.find(Path(conf), proc) == [10, 11]


def test_kill_all_kills_a_holder_and_returns_once_it_is_gone(tmp_path):
    conf = tmp_path / "nginx.conf"
    conf.write_text("")
    fake_nginx = tmp_path / "nginx"  # comm is the executable's name
    shutil.copy(shutil.which("sleep"), fake_nginx)
    fd = os.open(conf, os.O_RDONLY)
    try:
        holder = subprocess.Popen([str(fake_nginx), "300"], pass_fds=(fd,))
    finally:
        os.close(fd)
    bystander = subprocess.Popen([str(fake_nginx), "300"])
    try:
        # comm changes at exec, which may finish a moment after Popen has returned.
        wait_until(lambda: nginxrun.find(conf) == [holder.pid])
        assert nginxrun.kill_all(conf) == [holder.pid]
        assert holder.wait(timeout=10) == -signal.SIGKILL
        assert bystander.poll() is None and nginxrun.find(conf) == []
    finally:
        for p in (holder, bystander):
            p.kill()
            p.wait()


def test_restarted_master_binds_after_its_predecessor_was_sigkilled(tmp_path):
    cfg = make_config(tmp_path / "run", frontends={"count": 1})
    render.render(cfg)
    conf = render.nginx_conf(cfg)
    argv = [sys.executable, "-m", "shmserve.nginxrun", "--binary", render.nginx_binary(cfg),
            str(conf)]
    log = (cfg.run_dir / "logs" / "nginx.log").open("w")
    first = subprocess.Popen(argv, stdout=log, stderr=log)
    second = None
    try:
        old_workers = _wait_for_workers(first.pid, conf)
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert nginxrun.find(conf) == old_workers  # the trap: workers outlive their master

        second = subprocess.Popen(argv, stdout=log, stderr=log)
        # A master forks workers only after it bound the port; one that cannot bind exits.
        _wait_for_workers(second.pid, conf)
        assert not set(nginxrun.find(conf)) & set(old_workers)
        assert "killed leftover nginx processes" in (cfg.run_dir / "logs" / "nginx.log").read_text()
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGQUIT)
                p.wait(timeout=30)
        nginxrun.kill_all(conf)
        log.close()


def _wait_for_workers(master: int, conf: Path, timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        workers = [pid for pid in nginxrun.find(conf) if pid != master and _ppid(pid) == master]
        if workers:
            return workers
        assert Path(f"/proc/{master}").exists() and _state(master) != "Z", \
            f"nginx master {master} exited; see its log"
        assert time.monotonic() < deadline, f"nginx master {master} forked no worker"
        time.sleep(0.02)


def _stat(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return ["X", "0"]


def _state(pid: int) -> str:
    return _stat(pid)[0]


def _ppid(pid: int) -> int:
    return int(_stat(pid)[1])


def _listen(path: Path) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    return server


def test_nginx_waits_for_a_frontend_to_listen(tmp_path):
    """nginx listening with no frontend behind it answered 502 for the first seconds after
    `up`: the launcher waits until a frontend listens, not until its socket file exists (a
    stopped frontend leaves the file)."""
    sockets = [tmp_path / "frontend-0.sock", tmp_path / "frontend-1.sock"]
    _listen(sockets[0]).close()  # a stopped frontend's file: refuses connections
    assert sockets[0].exists() and not nginxrun.listening(sockets[0])
    servers = []
    threading.Timer(0.3, lambda: servers.append(_listen(sockets[1]))).start()
    started = time.monotonic()
    try:
        # One listens at 0.3 s; the other never does: nginx starts after the grace.
        assert nginxrun.wait_for_frontends(sockets, 10, grace_s=0.5)
        assert 0.75 < time.monotonic() - started < 5
        assert nginxrun.listening(sockets[1])
        # Both listening: no wait at all.
        servers.append(_listen(tmp_path / "frontend-2.sock"))
        started = time.monotonic()
        assert nginxrun.wait_for_frontends([sockets[1], tmp_path / "frontend-2.sock"], 10)
        assert time.monotonic() - started < 1
    finally:
        for server in servers:
            server.close()
    assert not nginxrun.wait_for_frontends([tmp_path / "never.sock"], 0.2)  # starts anyway
    assert signal.getsignal(signal.SIGQUIT) == signal.SIG_DFL  # nginx gets QUIT as before


def test_the_rendered_command_names_every_frontend_socket(tmp_path):
    cfg = make_config(tmp_path / "run", frontends={"count": 2})
    render.render(cfg)
    text = supervisor_files.supervisord_conf(cfg).read_text()
    line = next(line for line in text.splitlines() if "shmserve.nginxrun" in line)
    for i in range(2):
        assert f"--frontend {cfg.run_dir}/sockets/frontend-{i}.sock" in line
