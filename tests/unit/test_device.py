"""The worker's device helpers that run anywhere (the GPU's: tests/integration/test_model.py)."""

import os
import threading

import pytest
import torch

from gpu_workers.device import device_lost, yield_cores
from gpu_workers.memory import out_of_memory


def nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_yield_cores_lowers_only_the_calling_threads_priority():
    """A hot reload's loader thread (workers.reload_nice): the model thread that serves keeps
    its priority, and a thread the loader starts inherits the loader's."""
    before = nice_of_this_thread()
    seen = {}

    def loader():
        seen["returned"] = yield_cores(10)
        seen["loader"] = nice_of_this_thread()
        child = threading.Thread(target=lambda: seen.update(child=nice_of_this_thread()))
        child.start()
        child.join()

    thread = threading.Thread(target=loader)
    thread.start()
    thread.join()
    want = min(19, before + 10)
    assert seen == {"returned": want, "loader": want, "child": want}
    assert nice_of_this_thread() == before


def test_yield_cores_by_nothing_or_past_the_bottom():
    seen = {}

    def loader():
        seen["zero"] = yield_cores(0)
        seen["far"] = yield_cores(100)

    before = nice_of_this_thread()
    thread = threading.Thread(target=loader)
    thread.start()
    thread.join()
    assert seen == {"zero": before, "far": 19}


@pytest.mark.parametrize("exc, lost, oom", [
    (torch.AcceleratorError("CUDA error: device-side assert triggered"), True, False),
    (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), True, False),
    (RuntimeError("CUDA error: unspecified launch failure"), True, False),
    (torch.AcceleratorError("CUDA error: out of memory"), False, True),  # halved, retried
    (RuntimeError("CUDA error: out of memory"), False, True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False, True),
    (RuntimeError("shape mismatch"), False, False),  # a bad batch, not the device
    (IndexError("index out of range in self"), False, False),
])
def test_which_errors_end_the_worker_and_which_are_out_of_memory(exc, lost, oom):
    assert (device_lost(exc), out_of_memory(exc)) == (lost, oom)
