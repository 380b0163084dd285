"""The worker's device: the one GPU CUDA_VISIBLE_DEVICES shows it, else the CPU; what the CPU
computes natively; memory given back once a model is replaced.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger("shmserve.worker")


def cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX), so bf16 is faster."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def configure_cuda(cudnn_attention: bool) -> None:
    """Attention on a GPU without cuDNN's kernels unless asked for: cuDNN builds an execution
    plan the first time it sees each shape (~50 ms on an H200), and a server's passes come in
    ever new (texts, length) shapes. The memory-efficient kernel, which masked attention runs
    instead, costs the same on a new shape as on a known one (docs/performance.md)."""
    torch.backends.cuda.enable_cudnn_sdp(cudnn_attention)


class DeviceError(RuntimeError):
    """A worker given a GPU cannot use it; the message names workers.devices."""


class DeviceLost(RuntimeError):
    """The device failed a pass with an error its context does not recover from: the worker
    answers what it holds and exits, and supervisord starts it again on a fresh context."""


def device_lost(exc: BaseException) -> bool:
    """A CUDA error other than a failed allocation (a device-side assert, an illegal memory
    access, ECC, a lost device): after most of these the process's CUDA context fails every
    later call, so a worker that went on would fail every pass while its heartbeats said it
    was ready. A failed allocation is gpu_workers.memory's (halved and retried)."""
    from gpu_workers.memory import out_of_memory

    return not out_of_memory(exc) and (isinstance(exc, torch.AcceleratorError) or (
        type(exc) is RuntimeError and str(exc).startswith("CUDA error")))


def pick_device(threads: int, cudnn_attention: bool = False, gpu: str = "",
                fallback: bool = False) -> torch.device:
    """The worker's device: the one GPU CUDA_VISIBLE_DEVICES shows it, else the CPU. `gpu`: the
    GPU this worker was given (workers.devices, or `auto` finding one): it must see it, for a
    worker that served on the CPU instead would pass for a GPU deployment at a fraction of its
    speed, unless `fallback` (workers.cpu_fallback) asks for the CPU then. A CPU worker (no
    `gpu`) has CUDA_VISIBLE_DEVICES empty and gets the CPU."""
    if torch.cuda.is_available():
        configure_cuda(cudnn_attention)
        return torch.device("cuda", 0)
    if gpu:
        why = ("this torch is built without CUDA" if torch.version.cuda is None
               else f"CUDA {torch.version.cuda} finds no device (driver, container runtime?)")
        if not fallback:
            raise DeviceError(f"workers.devices: this worker was given GPU {gpu}, but {why}; "
                              "use a machine where `nvidia-smi` shows it, or set "
                              "workers.devices to auto (the CPU when there is no GPU) or cpu, "
                              "or workers.cpu_fallback to true")
        log.warning("worker.cpu_fallback", extra={"fields": {"gpu": gpu, "why": why}})
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return "cpu"


def release(device: torch.device) -> bool:
    """Once a replaced model is unreferenced: collect it (its modules hold reference cycles),
    give the freed heap back to the system (`trim_heap`) and, on a GPU, return its cached
    memory to the driver. True when it emptied the cache."""
    gc.collect()
    trim_heap()
    if device.type != "cuda":
        return False
    torch.cuda.empty_cache()
    return True


def trim_heap() -> None:
    """glibc keeps freed memory in its heap for reuse: a worker held ~100-200 MB more after a
    hot reload for good (a soak test), and the warm-up's largest batch stays in its RSS. In
    process, all-MiniLM-L6-v2 (fp32 load, bf16, 2026-12-02): a replaced model's worker 567 MB,
    457 MB after malloc_trim. Not glibc (musl): nothing to do."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def yield_cores(nice: int) -> int:
    """Lower the calling thread's CPU priority by `nice` (Linux keeps a nice value per thread;
    the threads it starts, an OpenMP team among them, inherit it) and return the new value.
    For a hot reload's loader thread (`workers.reload_nice`), whose loading and warm-up share
    the cores with the model thread that serves meanwhile. A thread cannot raise its priority
    back without privileges, so this is for threads that end."""
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        if nice > 0:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, now + nice))
        return os.getpriority(os.PRIO_PROCESS, tid)
    except (OSError, AttributeError):  # not Linux: the process's value, or none to set
        return 0
