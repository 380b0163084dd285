"""What `shmserve up` (and `apply`) check before anything starts, each failing with a message
that says what to change: the shared-memory mount, the port, the stdout supervisord reopens; and
the CLI's error and its argparse type for seconds. Re-exported by shmserve.cli."""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from pathlib import Path

from shmserve.config import Config
from shmserve.layers import ENV_PREFIX


class CliError(RuntimeError):
    """A command cannot go on; the message says why and what to change."""


def check_stdout(path: str = "/dev/stdout") -> None:
    """supervisord opens /dev/stdout again for each program (logging.stdout); when this user
    cannot (a stdout another user owns: `su`, `setpriv`, some runtimes), every program failed
    to spawn with "EACCES", retried for ever, and nothing said why (an outside check)."""
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise CliError(f"logging.stdout: supervisord cannot open {path} for its programs' "
                       f"lines ({exc.strerror}): this user (uid {os.getuid()}) cannot reopen "
                       "its own stdout, which another user owns; run with a stdout it owns "
                       "(a container runtime's), or logging.stdout: false") from None


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0 (a --timeout of 0 or less was taken,
    and the command acted before it failed: `apply --timeout 0` stopped a loading worker, an
    outside check)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: a number of seconds > 0")
    return value


def check_shm(cfg: Config, directory: Path = Path("/dev/shm")) -> None:
    """Fail before starting anything when /dev/shm is smaller than the frontends' arenas may
    grow to: a frontend reserves an arena's pages as requests first need them, and once the
    mount is full the requests that need more are refused (503, shmserve.arena.ShmFull).
    Docker's default /dev/shm is 64 MiB. Warn when it is large enough but others hold so much
    of it that the arenas may not fit."""
    need = cfg.frontends.count * cfg.shm.arena_mb * 2**20
    stat = os.statvfs(directory)
    size, free = stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize
    mib = lambda n: f"{n / 2**20:,.0f} MiB"  # noqa: E731
    what = (f"the {mib(need)} the frontends' arenas may use (frontends.count "
            f"{cfg.frontends.count} x shm.arena_mb {cfg.shm.arena_mb})")
    if size < need:
        raise CliError(f"{directory} holds {mib(size)}, less than {what}: requests would be "
                       "refused (503) once it fills. Mount a larger one (docker run "
                       "--shm-size=2g; Kubernetes: an emptyDir of medium Memory, as "
                       "deploy/kubernetes) or lower shm.arena_mb")
    if free < need:
        print(f"shmserve: warning: {directory} has {mib(free)} free of {mib(size)}, less than "
              f"{what}; under load requests may be refused (503) when it fills",
              file=sys.stderr)


def check_fds(cfg: Config) -> None:
    """Warn when the open-files limit (its hard limit: supervisord raises the soft one to it)
    is below what nginx's connections need: past it nginx fails connections with a bare HTML
    500, not the JSON error shape, and cannot even open its error pages (an outside check
    under `ulimit -n 256`: 198 of 3,000 requests)."""
    import resource

    from shmserve import nginx_options

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    want = nginx_options.nginx_connections(cfg) + 1024  # and some for files
    if hard != resource.RLIM_INFINITY and hard < want:
        print(f"shmserve: warning: the open-files limit is {hard} (ulimit -Hn), under the "
              f"{want} nginx's connections may need (nginx.worker_connections "
              f"{nginx_options.worker_connections(cfg)}): under that many connections nginx "
              "answers bare 500s; raise it (ulimit -n, systemd's LimitNOFILE, the container's "
              "nofile) or lower nginx.worker_connections and frontends.max_inflight",
              file=sys.stderr)


def check_reachable(cfg: Config) -> None:
    """Warn of a size no request can reach, so a rule set never applies (frontends.bulk_texts
    over limits.max_texts_per_request was taken without a word: a noted gap)."""
    most = cfg.limits.max_texts_per_request
    bulk, part = cfg.frontends.bulk_texts, cfg.frontends.spread_part_texts
    for key, value, size, rule in (
            ("frontends.bulk_texts", bulk, bulk, "no request runs a step below as bulk"),
            ("frontends.spread_part_texts", part, 2 * part,
             "no request is spread over idle workers (it needs twice this many texts)")):
        if size > most:
            print(f"shmserve: warning: {key} {value} needs requests of {size} texts or more, "
                  f"over limits.max_texts_per_request ({most}): {rule}; lower it, or set 0 "
                  "where the rule is meant to be off", file=sys.stderr)


def check_port(cfg: Config, keys: tuple[str, ...] = ("server.port", "server.grpc_port")) -> None:
    """Fail before starting anything when server.port (or server.grpc_port, where set) is taken
    (nginx would retry for ever, and a ready check through the port would be answered by
    whoever holds it)."""
    host = cfg.server.host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    ports = [(key, getattr(cfg.server, key.split(".")[1])) for key in keys]
    for key, port in ports:
        if not port:  # server.grpc_port 0: no gRPC
            continue
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as nginx binds
            try:
                probe.bind((host, port))
            except OSError as exc:
                env = ENV_PREFIX + key.replace(".", "__").upper()
                if exc.errno == errno.EADDRINUSE:
                    raise CliError(f"{host}:{port} is in use by {port_holder(port)}; choose "
                                   f"another {key} ({env}) or stop it") from None
                raise CliError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def port_holder(port: int) -> str:
    """Who listens on TCP `port`, as far as this user can see: the nginx of a shmserve
    deployment, named by its run directory (another checkout's, or this one's started with
    another server.run_dir: "another process" alone left a user looking), another process by
    its pid and name, or "another process" where the owner cannot be read."""
    import psutil

    try:
        pids = {c.pid for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}
    except (psutil.Error, OSError):
        return "another process"
    for pid in sorted(pids):
        try:
            proc = psutil.Process(pid)
            master = proc.parent() if proc.name() == "nginx" and proc.ppid() != 1 else None
            argv = (master if master is not None and master.name() == "nginx" else proc).cmdline()
            name = proc.name()
        except psutil.Error:
            continue
        # nginx as shmserve runs it (shmserve.nginxrun): -p RUN_DIR/nginx/ -c RUN_DIR/nginx/...
        if name == "nginx" and "-p" in argv[:-1]:
            prefix = Path(argv[argv.index("-p") + 1])
            if (prefix.parent / "supervisord.conf").exists():
                return (f"the nginx of another shmserve deployment (run_dir {prefix.parent}: "
                        "`shmserve down` there)")
        return f"another process (pid {pid}, {name})"
    return "another process"

