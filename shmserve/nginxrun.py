"""``python -m shmserve.nginxrun [--binary PATH] CONF``: how supervisord starts nginx.

The trap: when nginx's master dies by SIGKILL, its workers live on and keep the listening
socket, so the master supervisord starts next cannot bind and crash-loops. Before it execs
nginx, this launcher SIGKILLs every nginx process of this deployment still around.

How a process is known to be ours: the launcher leaves CONF open, without close-on-exec, across
the exec, so the master and every worker it forks hold a descriptor on CONF. A process is ours
when its comm is ``nginx`` and one of its ``/proc/PID/fd`` links is CONF (or ``CONF (deleted)``
once a re-render replaced the file). An environment marker would not do: nginx writes its
process title over its environ area, so ``/proc/PID/environ`` no longer shows it.

exec keeps the pid, so supervisord's signals (QUIT to stop) reach the master directly.

Before that it waits (up to ``--wait-s``) until a frontend listens on its socket
(``--frontend``), so that nginx never listens with no frontend behind it: a client gets
connection refused while the deployment starts, not a 502 from nginx (and nginx logs no failed
connect per request). Once one listens, it gives the others, which start with it, a moment
(GRACE_S): nginx logs a connect to a socket file not yet there at level crit, where one that
refuses (a frontend restarting: frontends leave their socket file when they stop) is an error.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

PROC = Path("/proc")
DELETED = " (deleted)"


def find(conf: Path, proc: Path = PROC) -> list[int]:
    """Pids of nginx processes holding CONF open."""
    wanted = {str(conf), str(conf) + DELETED}
    pids = []
    for entry in proc.iterdir():
        if entry.name.isdigit() and _comm(entry) == "nginx" and _holds(entry, wanted):
            pids.append(int(entry.name))
    return sorted(pids)


def kill_all(conf: Path, timeout_s: float = 10.0, proc: Path = PROC) -> list[int]:
    """SIGKILL every nginx process holding CONF; return once none is left (or raise)."""
    deadline = time.monotonic() + timeout_s
    killed: list[int] = []
    while pids := find(conf, proc):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nginx processes {pids} holding {conf} outlived SIGKILL "
                               f"for {timeout_s} s")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed.extend(p for p in pids if p not in killed)
        time.sleep(0.02)  # a killed process drops its descriptors as it exits
    return killed


def _comm(entry: Path) -> str:
    try:
        return (entry / "comm").read_text().strip()
    except OSError:  # gone, or not ours to read
        return ""


def _holds(entry: Path, wanted: set[str]) -> bool:
    try:
        fds = list((entry / "fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd) in wanted:
                return True
        except OSError:
            continue
    return False


GRACE_S = 2.0  # once a frontend listens, how long nginx waits for the others


def listening(path: Path) -> bool:
    """Whether a process accepts connections on the unix socket `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(str(path))
        except OSError:  # no file yet, or one that no process listens on
            return False
        return True


def wait_for_frontends(paths: list[Path], timeout_s: float, grace_s: float = GRACE_S) -> bool:
    """Whether a frontend listens on one of `paths` within `timeout_s` (polled every 50 ms);
    once one does, up to `grace_s` more for the rest. supervisord may stop nginx meanwhile: QUIT
    or TERM then ends the wait, and this process, at once."""
    for signum in (signal.SIGQUIT, signal.SIGTERM):
        signal.signal(signum, lambda *_: sys.exit(0))
    deadline = time.monotonic() + timeout_s
    first = False
    try:
        while (up := sum(map(listening, paths))) < len(paths):
            if up and not first:
                first, deadline = True, min(deadline, time.monotonic() + grace_s)
            if time.monotonic() > deadline:
                return up > 0
            time.sleep(0.05)
        return True
    finally:
        for signum in (signal.SIGQUIT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shmserve.nginxrun")
    parser.add_argument("--binary", default="nginx", help="the nginx executable")
    parser.add_argument("--frontend", type=Path, action="append", default=[],
                        help="a frontend's socket; nginx starts once one listens")
    parser.add_argument("--wait-s", type=float, default=30.0,
                        help="how long to wait for a frontend's socket before starting anyway")
    parser.add_argument("conf", type=Path, help="the rendered <run_dir>/nginx/nginx.conf")
    args = parser.parse_args(argv)
    conf = args.conf.resolve()
    if args.frontend and not wait_for_frontends(args.frontend, args.wait_s):
        print(f"nginxrun: no frontend socket after {args.wait_s:g} s; starting nginx anyway "
              "(it answers 502 until one listens)", flush=True)
    binary = shutil.which(args.binary) or args.binary
    killed = kill_all(conf)
    if killed:
        print(f"nginxrun: killed leftover nginx processes {killed}", flush=True)
    marker = os.open(conf, os.O_RDONLY)  # the descriptor that marks our processes; see above
    os.set_inheritable(marker, True)
    argv_nginx = [binary, "-e", "stderr", "-p", f"{conf.parent}/", "-c", str(conf)]
    print(f"nginxrun: exec {' '.join(argv_nginx)}", flush=True)
    os.execv(binary, argv_nginx)
    return 1  # not reached: execv replaces this process or raises


if __name__ == "__main__":
    sys.exit(main())
