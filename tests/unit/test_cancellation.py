"""A client that goes away cancels its handler at any await, also at the instant the awaited
thing completes. asyncio.wait_for (Python 3.11) then returned the result and swallowed the
cancellation: an outside check saw nginx log 499 while the frontend logged a 200 and the worker
computed all 64 texts of a request tokenized in a thread (5 of ~150 aborted requests)."""

import asyncio
import threading
import time

import pytest

from frontend.tasks import off_loop


async def cancel_as_it_completes(start, complete) -> asyncio.Task:
    """Start `start()` as a task and let it wait; then, with the loop held, `complete()` what
    it waits for and cancel it, so that both wake-ups are queued before the task runs again
    (the completion first)."""
    task = asyncio.create_task(start())
    await asyncio.sleep(0.05)  # the task is waiting
    complete()
    time.sleep(0.2)  # the loop held: a thread's completion is queued meanwhile
    task.cancel()
    return task


async def test_a_cancel_as_tokenizing_ends_is_not_lost():
    release = threading.Event()

    async def start():
        return await off_loop(lambda encoder: release.wait(5) and encoder, "encoded",
                              time.time() + 5)

    task = await cancel_as_it_completes(start, release.set)
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_tokenizing_past_the_deadline_is_a_504():
    from frontend.errors import ApiError

    with pytest.raises(ApiError) as info:
        await off_loop(lambda encoder: time.sleep(0.3), None, time.time() + 0.05)
    assert info.value.status == 504


async def test_a_cancel_as_a_worker_becomes_ready_is_not_lost(pool):
    """Waiting for a worker (none ready): the pool's change event is set as the client goes;
    the wait must end in CancelledError, not go on waiting (and then submit) for no one."""
    task = await cancel_as_it_completes(lambda: pool.wait_for_worker("a", 5.0),
                                        pool._changed.set)
    started = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < 1.0
