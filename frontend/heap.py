"""The heap a large request grew, given back to the OS once the frontend is idle.

glibc keeps what a process freed for its next allocations, in one arena per thread that
allocated (the tokenizing threads' too), and gives back only whole free pages at an arena's top
unless asked. A frontend that answered a few requests of thousands of long texts held several
hundred MB after them (an outside check: 370-390 MB against ~75 MB fresh, after bursts of four
7.8 MB requests at once, with tokenizing in chunks; 1.6-1.9 GB before that), which on a
memory-limited pod is room the next burst does not have. `malloc_trim(0)` returns every free
page of every arena: ~10 ms for a heap of ~120 MB, on the default executor, only after such a
request, and only once nothing is in flight, so no request waits on it.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import Callable

import psutil

log = logging.getLogger("shmserve.frontend")

TRIM_CHARS = 256 << 10  # a request of this many characters or more is followed by a trim
IDLE_CHECK_S = 2.0  # how often a frontend looks for its idle moment after one


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def resident_mb() -> float:
    """This process's resident memory, MiB."""
    return psutil.Process().memory_info().rss / (1 << 20)


class HeapTrim:
    """`note` each request's size; `watch` trims once none is in flight after a large one."""

    def __init__(self, trim: Callable[[int], int] | None = None) -> None:
        self.trim = trim if trim is not None else _malloc_trim()
        self.pending = False

    def note(self, chars: int) -> None:
        if chars >= TRIM_CHARS:
            self.pending = True

    async def watch(self, inflight: list[int], every_s: float = IDLE_CHECK_S) -> None:
        """Until cancelled: every `every_s`, trim if a large request came since the last trim
        and nothing (`inflight[0]`: the frontend's requests in flight) runs now."""
        if self.trim is None:
            return
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(every_s)
            if self.pending and inflight[0] == 0:
                self.pending = False
                before = resident_mb()
                await loop.run_in_executor(None, self.trim, 0)
                log.info("frontend.heap_trimmed", extra={"fields": {
                    "resident_mb_before": round(before, 1),
                    "resident_mb_after": round(resident_mb(), 1)}})
