"""Device memory care: read the caching allocator now and then, report it, and give cached
blocks back when too much of what is reserved sits unused.

Fragmentation is (reserved - allocated) / reserved: the share of the allocator's reserved device
memory that no tensor uses. Padding-heavy batches of changing shapes leave such blocks behind;
`torch.cuda.empty_cache()` returns them to the driver (at the price of allocating again later),
so it is called only above `workers.empty_cache_threshold`, at a check. A check runs every
`workers.memory_check_batches` batches, and when the worker is idle at most once per heartbeat
interval, always in the model thread (the allocator is not read from other threads).

GPU workers start with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True by default
(`workers.cuda_alloc_conf`, set by shmserve.render), which keeps fragmentation low in the first
place. On the CPU there is no device allocator: checks do nothing (the resident memory of every
process is reported at scrape time by `shmserve.metrics.ResidentMemory`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("shmserve.worker")


@dataclass(frozen=True, slots=True)
class Reading:
    allocated: int  # bytes held by tensors
    reserved: int  # bytes held by the caching allocator
    peak: int  # most bytes held by tensors since start

    @property
    def fragmentation(self) -> float:
        return (self.reserved - self.allocated) / self.reserved if self.reserved > 0 else 0.0


def should_empty_cache(reading: Reading, threshold: float) -> bool:
    """The policy: empty the cache when the unused share of reserved memory passes threshold."""
    return reading.reserved > 0 and reading.fragmentation > threshold


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

        return Reading(torch.cuda.memory_allocated(self.device),
                       torch.cuda.memory_reserved(self.device),
                       torch.cuda.max_memory_allocated(self.device))

    def empty_cache(self) -> None:
        import torch

        torch.cuda.empty_cache()


class Report(Protocol):
    """Where readings go (gpu_workers.metrics.WorkerMetrics)."""

    empty_cache: object  # a counter child with inc()

    def device_memory(self, allocated: int, reserved: int, peak: int,
                      fragmentation: float) -> None: ...


class MemoryCare:
    def __init__(self, allocator: Allocator, report: Report, every_batches: int,
                 interval_s: float, threshold: float) -> None:
        self.allocator = allocator
        self.report = report
        self.every_batches = every_batches
        self.interval_s = interval_s
        self.threshold = threshold
        self.emptied = 0
        self._batches = 0
        self._last = float("-inf")

    def after_batch(self, now: float) -> None:
        self._batches += 1
        if self._batches >= self.every_batches:
            self.check(now)

    def idle(self, now: float) -> None:
        if now - self._last >= self.interval_s:
            self.check(now)

    def check(self, now: float) -> Reading | None:
        """Read, maybe empty the cache, report what remains. None on the CPU."""
        self._batches, self._last = 0, now
        reading = self.allocator.read()
        if reading is None:
            return None
        if should_empty_cache(reading, self.threshold):
            self.allocator.empty_cache()
            self.emptied += 1
            self.report.empty_cache.inc()
            after = self.allocator.read() or reading
            log.info("worker.empty_cache", extra={"fields": {
                "fragmentation": round(reading.fragmentation, 3),
                "reserved_before": reading.reserved, "reserved_after": after.reserved,
                "allocated": after.allocated}})
            reading = after
        self.report.device_memory(reading.allocated, reading.reserved, reading.peak,
                                  reading.fragmentation)
        return reading
