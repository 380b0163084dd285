"""What a frontend cannot serve without, watched every second off the request path: its
shared-memory arena's file and its socket's (and the arena's gauge,
shmserve_frontend_arena_used_bytes)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Callable

from frontend import metrics
from shmserve import arena as shm
from shmserve.config import Config

log = logging.getLogger("shmserve.frontend")


async def watch(arena: shm.Arena, index: int, socket: Path,
                grpc_socket: Callable[[], Path | None] = lambda: None) -> None:
    """Every second, off the request path: shmserve_frontend_arena_used_bytes; and the files
    this frontend cannot serve without. Its arena's file deleted (a /dev/shm cleaner, RemoveIPC)
    left every request 503 for good, as no worker could map it; its socket's file deleted or
    replaced, nginx reached it no more (outside checks). Then it stops, as at a SIGTERM (it
    drains), and supervisord starts it again, with new ones. `grpc_socket`: the gRPC server's
    socket file while it serves (None before it starts, once its stop began, and without
    server.grpc_port): deleted, every gRPC call was UNAVAILABLE for good, /ready 200 (an outside
    check)."""
    gauge = metrics.ARENA_USED.labels(str(index))
    bound = {socket: _inode(socket)}  # (none where the app serves no socket: the tests')
    while True:
        gauge.set(arena.bytes_used)
        watched = [socket]
        if (grpc := grpc_socket()) is not None:
            watched.append(grpc)
            bound.setdefault(grpc, _inode(grpc))
        gone = next((path for path in watched
                     if bound[path] is not None and _inode(path) != bound[path]), None)
        lost = (f"its shared-memory arena {arena.path}" if arena.unlinked() else
                f"its socket {gone}" if gone is not None else None)
        if lost:
            log.error("frontend.file_lost", extra={"fields": {
                "frontend": index, "lost": lost,
                "action": "stopping (it drains); supervisord starts it again"}})
            os.kill(os.getpid(), signal.SIGTERM)
            return
        await asyncio.sleep(1.0)


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def grpc_socket(app, cfg: Config) -> Path | None:
    """The gRPC server's socket file while it serves (server.grpc_port): none before it
    started, once its stop began (which puts its own placeholder there), or without gRPC."""
    if not cfg.server.grpc_port:
        return None
    from frontend.grpc_server import GRPC_SERVER  # (grpc is imported only where it is served)

    server = app.get(GRPC_SERVER)
    return None if server is None else server.serving_at
