"""``python -m frontend --config RUN_DIR/config.json --index I`` (supervisord runs this)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shmserve.config import Config

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # each drains, then exits
# Other daemons' "reopen your logs" (nginx's USR1, logrotate's postrotate habit): a program
# logs to its stdout, which supervisord writes and rotates, so there is nothing to reopen.
# Their default action killed the frontend on the spot, without a drain (`supervisorctl
# signal USR1 all`: "terminated by SIGUSR1; not expected", every frontend at once).
IGNORED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def bind_in_place(path: Path, backlog: int) -> socket.socket:
    """A listening unix socket at `path`, put there by rename(2) over the file a previous run
    left, so that the path never stops existing. Binding at the path itself (asyncio's
    create_unix_server) unlinks the old file first: a connect in that gap finds no file, which
    nginx logs at level crit (seen once in a rolling restart of the test suite), where a connect
    to the old file, before the rename, is refused and logged as an error."""
    # No longer than frontend-N.sock: run_dir is checked for the socket paths' length (108
    # bytes), so a longer staging name could not bind where the real one can.
    staging = path.with_name(f".{os.getpid()}")
    staging.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(staging))
        sock.listen(backlog)
        os.replace(staging, path)
    except BaseException:
        sock.close()
        staging.unlink(missing_ok=True)
        raise
    return sock


def main() -> int:
    # First, before the imports (aiohttp, tokenizers, the app: a second or more on a small
    # machine): a USR1 or USR2 in them killed the frontend as it started (an outside check:
    # "terminated by SIGUSR1; not expected" at 1.5 to 4 s of its start).
    for signum in IGNORED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="frontend")
    parser.add_argument("--config", required=True, help="the resolved config.json in the run dir")
    parser.add_argument("--index", type=int, required=True)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from shmserve import logs, program_config
    from shmserve.models import ModelSourceError

    # config.json, or the config it ran before an apply that has not reached it yet
    cfg, before_apply = program_config.load(args.config, f"frontend-{args.index}",
                                            read_keys=True)
    logs.configure(cfg.logging, f"frontend-{args.index}")
    log = logging.getLogger("shmserve.frontend")
    if before_apply:
        log.warning("frontend.config_before_apply", extra={"fields": {"config": before_apply}})
    try:
        return serve(cfg, args.index)
    except ModelSourceError as exc:
        # A model it cannot serve (a tokenizer.json that does not load): as a worker's
        # worker.failed, a line that says what to change, not a traceback at every restart.
        logs.failed(log, "frontend.failed", exc, traceback=False)
    except Exception as exc:
        logs.failed(log, "frontend.failed", exc)
    return 1


def serve(cfg: Config, index: int) -> int:
    """Bind frontend `index`'s socket and serve on it until a stop signal's drain ends."""
    import uvloop
    from aiohttp import web

    from frontend.app import create_app
    from frontend.httpparser import header_count_limit, header_limit, malformed_request
    from shmserve import topology

    path = topology.frontend_socket(cfg, index)
    web.RequestHandler.handle_error = malformed_request  # no plain text quoting the request
    # uvloop: the frontends' per-request CPU is what bounds the pipeline on small models.
    loop = uvloop.new_event_loop()

    def stop() -> None:
        """The first SIGTERM, SIGINT or SIGHUP starts the drain; later ones are ignored until the
        process exits. At supervisord's stop the reaper sends one
        (shmserve.reaper.drain_frontends) and supervisord another once nginx is gone: aiohttp's
        own handler raised it in the middle of the drain, cutting it short, and once the loop
        had closed (which puts back the default action of the signals it handled) it killed the
        frontend in its exit, which supervisord logged as "terminated by SIGTERM" (an outside
        check: 2 of 3 frontends at every `down`). The loop's handlers are removed first, so
        it does not put the default back at its close. SIGHUP (`supervisorctl signal HUP`)
        killed the frontend without a drain: it drains and exits, and supervisord starts it
        again."""
        ignore_stops()
        if cfg.server.grpc_port:
            # The gRPC calls drain first, while the HTTP socket they call still listens
            from frontend import grpc_server

            grpc_server.stop_calls_then(app, lambda: loop.call_soon(graceful_exit))
            return
        raise web.GracefulExit()

    def ignore_stops() -> None:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
            signal.signal(signum, signal.SIG_IGN)

    def graceful_exit() -> None:
        raise web.GracefulExit()  # out of run_app's loop, as a signal handler's would

    # uvloop drops a signal that arrives after add_signal_handler but before the loop runs
    # (its wakeup fd is set only then): a `down` right after an `up` signalled a frontend
    # loading its tokenizers, which then served on until SIGKILL (CI). Until the loop runs,
    # a stop signal is recorded here; the loop's first callback installs its handlers, then
    # stops at once if one came (what of the app's startup ran, run_app cleans up).
    early: list[int] = []
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda signum, frame: early.append(signum))

    def listen() -> None:
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, stop)
        if early:
            ignore_stops()
            graceful_exit()

    loop.call_soon(listen)  # before run_app's own task: its first step comes after
    sock = bind_in_place(path, cfg.frontends.listen_backlog)
    if not cfg.server.grpc_port:  # gRPC turned off by an apply: its stopped socket file goes
        topology.frontend_grpc_socket(cfg, index).unlink(missing_ok=True)
    app = create_app(cfg, index)
    web.run_app(app, sock=sock, print=None, loop=loop,
                shutdown_timeout=cfg.server.drain_timeout_s, access_log=None,
                handle_signals=False, backlog=cfg.frontends.listen_backlog,
                # A client that goes away cancels its handler, which aborts its queued work
                # at the worker (frontend.dispatch) instead of computing it for nobody.
                handler_cancellation=True,
                # frontend.codec.read_raw inflates compressed bodies itself, with JSON errors.
                auto_decompress=False,
                max_line_size=header_limit(cfg), max_field_size=header_limit(cfg),
                max_headers=header_count_limit(cfg))
    # The socket file stays (the next start renames its own over it; `shmserve down` removes
    # it): while this frontend restarts nginx's connects to it are refused, which nginx logs as
    # an error, where a missing file is logged at level crit, and alerting on crit would fire at
    # every rolling restart.
    return 0


if __name__ == "__main__":
    sys.exit(main())
