"""Device memory care: read the caching allocator now and then, report it, and give its unused
blocks back to the driver when someone else needs them, never while they are being reused.

Under load a worker's cache is its working set: every pass frees its activations, and the next
pass takes the same blocks again. Emptying it then only makes the next passes allocate from the
driver again (and `torch.cuda.empty_cache()` synchronizes the device). An earlier policy emptied
whenever (reserved - allocated) / reserved passed a threshold; read between passes, when every
activation is free, that share is ~0.75 on any busy worker, so it emptied a warm cache every
100 passes (8 calls in 12 s on an H200, docs/performance.md). The cache is given back only:

  * when the device runs short: the driver's free memory (all processes on the GPU: another
    worker with `workers.per_gpu`, another program) is under `workers.empty_cache_free_below` of
    the device at a check;
  * when the worker is idle: no pass for `workers.empty_cache_idle_s` seconds, once per idle
    spell (the next pass reallocates);
  * after a pass ran out of memory (`after_oom`; the worker then retries the pass in halves);

and only when the cache holds at least `MIN_RELEASE` bytes unused. A check runs every
`workers.memory_check_batches` passes and, while idle, at most once per heartbeat interval;
always in the model thread (the allocator is not read from other threads).

Fragmentation, reported, is PyTorch's own measure: the share of reserved memory in free pieces
of segments that also hold live tensors (`inactive_split_bytes`), which no `empty_cache()` can
return and which a large allocation may not fit. GPU workers start with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True by default (`workers.cuda_alloc_conf`), and
PyTorch leaves expandable segments out of that count (their wholly free pages can always be
returned; c10/cuda/CUDACachingAllocator.cpp), so under the default the ratio reads 0 by
construction: it measures something only when `workers.cuda_alloc_conf` turns them off. On the
CPU there is no device allocator: checks do nothing (the resident memory of
every process is reported at scrape time by `shmserve.metrics.ResidentMemory`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

log = logging.getLogger("shmserve.worker")

MIN_RELEASE = 64 << 20  # bytes: less unused cache than this is not worth a driver round trip


@dataclass(frozen=True, slots=True)
class Reading:
    allocated: int  # bytes held by tensors
    reserved: int  # bytes held by the caching allocator
    peak: int  # most bytes held by tensors since start
    inactive_split: int = 0  # free bytes inside segments that also hold live tensors
    free: int = 0  # the device's free memory, as the driver reports it (every process's use)
    total: int = 0  # the device's memory; 0: unknown

    @property
    def unused(self) -> int:
        """Bytes the cache holds that no tensor uses."""
        return self.reserved - self.allocated

    @property
    def fragmentation(self) -> float:
        return self.inactive_split / self.reserved if self.reserved > 0 else 0.0

    @property
    def free_share(self) -> float:
        return self.free / self.total if self.total > 0 else 1.0


@dataclass(frozen=True, slots=True)
class Policy:
    idle_s: float  # no pass this long: give the cache back, once per idle spell (0: never)
    free_below: float  # the device's free share under this at a check: give it back (0: never)
    min_release: int = MIN_RELEASE

    @classmethod
    def of(cls, workers) -> "Policy":
        """From the config's `workers` section (shmserve.config.WorkerConfig)."""
        return cls(workers.empty_cache_idle_s, workers.empty_cache_free_below)


def empty_reason(reading: Reading, idle_for: float, policy: Policy) -> str | None:
    """Why the cache should be emptied now ("pressure" or "idle"), or None to keep it."""
    if reading.unused < policy.min_release:
        return None
    if reading.free_share < policy.free_below:
        return "pressure"
    if policy.idle_s > 0 and idle_for >= policy.idle_s:
        return "idle"
    return None


class Allocator(Protocol):
    def read(self) -> Reading | None: ...  # None: no device allocator (CPU)
    def empty_cache(self) -> None: ...


class TorchAllocator:
    """The CUDA caching allocator of one device; on the CPU `read` answers None."""

    def __init__(self, device) -> None:
        self.device = device

    def read(self) -> Reading | None:
        if self.device.type != "cuda":
            return None
        import torch

        stats = torch.cuda.memory_stats(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return Reading(stats.get("allocated_bytes.all.current", 0),
                       stats.get("reserved_bytes.all.current", 0),
                       stats.get("allocated_bytes.all.peak", 0),
                       stats.get("inactive_split_bytes.all.current", 0), free, total)

    def empty_cache(self) -> None:
        import torch

        torch.cuda.empty_cache()


class Report(Protocol):
    """Where readings go (gpu_workers.metrics.WorkerMetrics)."""

    def emptied(self, reason: str) -> None: ...

    def device_memory(self, reading: Reading) -> None: ...


class MemoryCare:
    def __init__(self, allocator: Allocator, report: Report, every_batches: int,
                 interval_s: float, policy: Policy) -> None:
        self.allocator = allocator
        self.report = report
        self.every_batches = every_batches
        self.interval_s = interval_s
        self.policy = policy
        self.emptied = 0
        self._batches = 0
        self._last_check = float("-inf")
        self._last_pass: float | None = None  # None: no pass yet; idle counts from the first check
        self._idle_emptied = False

    def after_batch(self, now: float) -> None:
        self._last_pass = now
        self._idle_emptied = False
        self._batches += 1
        if self._batches >= self.every_batches:
            self.check(now)

    def idle(self, now: float) -> None:
        if now - self._last_check >= self.interval_s:
            self.check(now)

    def check(self, now: float) -> Reading | None:
        """Read, maybe empty the cache, report what remains. None on the CPU."""
        self._batches, self._last_check = 0, now
        if self._last_pass is None:
            self._last_pass = now
        reading = self.allocator.read()
        if reading is None:
            return None
        reason = empty_reason(reading, now - self._last_pass, self.policy)
        if reason == "idle" and self._idle_emptied:
            reason = None
        if reason is not None:
            self._idle_emptied = reason == "idle"
            reading = self._empty(reason, reading)
        self.report.device_memory(reading)
        return reading

    def after_oom(self) -> None:
        """A pass ran out of device memory: give back what the cache holds before retrying."""
        reading = self.allocator.read()
        if reading is not None:
            self.report.device_memory(self._empty("oom", reading))

    def _empty(self, reason: str, before: Reading) -> Reading:
        self.allocator.empty_cache()
        self.emptied += 1
        self.report.emptied(reason)
        after = self.allocator.read() or before
        log.info("worker.empty_cache", extra={"fields": {
            "reason": reason, "reserved_before": before.reserved,
            "reserved_after": after.reserved, "allocated": after.allocated,
            "device_free": after.free}})
        return after


Group = tuple  # (ids [texts, width], lengths [texts], segments [texts] | None), as Model takes


def out_of_memory(exc: BaseException) -> bool:
    """A device (or host) allocation failed: torch.OutOfMemoryError from the caching allocator
    on a GPU, or a CUDA error that says "out of memory"; on the CPU torch's allocator raises a
    RuntimeError that says so."""
    import torch

    return (isinstance(exc, (torch.OutOfMemoryError, MemoryError))
            or (type(exc) is RuntimeError and "can't allocate memory" in str(exc))
            # a library's workspace or handle that CUDA could not allocate (cuBLAS, cuDNN)
            or (type(exc) in (torch.AcceleratorError, RuntimeError)
                and "CUDA error: out of memory" in str(exc)))


def forward_in_halves(forward: Callable[[list[Group]], np.ndarray], groups: list[Group],
                      on_oom: Callable[[], None], per_token: bool = False
                      ) -> tuple[np.ndarray | None, list[bool]]:
    """Run a pass; if it runs out of memory, call `on_oom` and run its two halves one after the
    other, halving again as needed, so one text too large for the device fails alone and
    co-batched texts still get answers. Returns (rows, ok): the rows of every text in the
    groups' order, one a text (`per_token`: one a token) and zeros where not ok (None when no
    text ran), and which texts ran."""
    chunks: list[tuple[np.ndarray | None, list[Group]]] = []

    def run(part: list[Group]) -> None:
        try:
            chunks.append((forward(part), part))
            return
        except Exception as exc:
            if not out_of_memory(exc):
                raise
        # The cache is emptied and the halves run once the except block has ended: until then
        # the exception's traceback holds the failed pass's frames, and so its activations,
        # which empty_cache could not give back and the halves would run beside (PyTorch's
        # FAQ, "My out of memory exception handler can't allocate memory").
        on_oom()
        if _texts(part) == 1:
            chunks.append((None, part))
            return
        for half in _halves(part):
            run(half)

    run(groups)
    ok = [rows is not None for rows, part in chunks for _ in range(_texts(part))]
    if len(chunks) == 1:  # the usual case (or one text that failed): no copy
        return chunks[0][0], ok
    done = [rows for rows, _ in chunks if rows is not None]
    if not done:
        return None, ok
    width, dtype = done[0].shape[1:], done[0].dtype
    return np.concatenate([
        rows if rows is not None else np.zeros((_row_count(part, per_token), *width), dtype)
        for rows, part in chunks]), ok


def _row_count(groups: list[Group], per_token: bool) -> int:
    return (sum(int(lengths.sum()) for _, lengths, _ in groups) if per_token
            else _texts(groups))


def _texts(groups: list[Group]) -> int:
    return sum(len(lengths) for _, lengths, _ in groups)


def _halves(groups: list[Group]) -> tuple[list[Group], list[Group]]:
    if len(groups) > 1:
        return groups[:len(groups) // 2], groups[len(groups) // 2:]
    ids, lengths, segments = groups[0]
    h = len(lengths) // 2
    return ([_rows(ids, lengths, segments, slice(0, h))],
            [_rows(ids, lengths, segments, slice(h, None))])


def _rows(ids: np.ndarray, lengths: np.ndarray, segments: np.ndarray | None,
          rows: slice) -> Group:
    """Some rows of a group, its padding cut to their longest text."""
    width = int(lengths[rows].max())
    return (np.ascontiguousarray(ids[rows, :width]), lengths[rows],
            None if segments is None else segments[rows])
