"""What a frontend cannot serve without, watched every second off the request path: its
shared-memory arena's file and its socket's (and the arena's gauge,
shmserve_frontend_arena_used_bytes)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

from frontend import metrics
from shmserve import arena as shm

log = logging.getLogger("shmserve.frontend")


async def watch(arena: shm.Arena, index: int, socket: Path) -> None:
    """Every second, off the request path: shmserve_frontend_arena_used_bytes; and the files
    this frontend cannot serve without. Its arena's file deleted (a /dev/shm cleaner, RemoveIPC)
    left every request 503 for good, as no worker could map it; its socket's file deleted or
    replaced, nginx reached it no more (outside checks). Then it stops, as at a SIGTERM (it
    drains), and supervisord starts it again, with new ones."""
    gauge = metrics.ARENA_USED.labels(str(index))
    bound = _inode(socket)  # (none where the app serves no socket: the tests')
    while True:
        gauge.set(arena.bytes_used)
        lost = (f"its shared-memory arena {arena.path}" if arena.unlinked() else
                f"its socket {socket}" if bound is not None and _inode(socket) != bound else
                None)
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
