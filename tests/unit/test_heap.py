"""frontend.heap: a frontend gives back the heap a large request grew, once idle."""

from __future__ import annotations

import asyncio

from frontend import heap


def test_a_trim_follows_a_large_request_once_nothing_is_in_flight():
    calls = []
    trim = heap.HeapTrim(trim=lambda pad: calls.append(pad) or 1)
    inflight = [0]

    async def scenario():
        watcher = asyncio.create_task(trim.watch(inflight, every_s=0.01))
        trim.note(heap.TRIM_CHARS - 1)  # small: nothing to give back
        await asyncio.sleep(0.05)
        assert calls == []
        inflight[0] = 1
        trim.note(heap.TRIM_CHARS)  # large, and still in flight: not yet
        await asyncio.sleep(0.05)
        assert calls == [] and trim.pending
        inflight[0] = 0  # idle: once
        await asyncio.sleep(0.05)
        assert calls == [0] and not trim.pending
        await asyncio.sleep(0.05)
        assert calls == [0]
        watcher.cancel()

    asyncio.run(scenario())


def test_glibcs_trim_is_found_and_runs():
    trim = heap._malloc_trim()
    assert trim is not None  # this machine's C library is glibc
    assert trim(0) in (0, 1) and heap.resident_mb() > 10
