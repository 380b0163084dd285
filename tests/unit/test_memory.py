"""The workers' device memory policy against a fake allocator: no GPU, no model."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from gpu_workers.memory import MemoryCare, Reading, TorchAllocator, should_empty_cache
from gpu_workers.metrics import WorkerMetrics

MiB = 1 << 20


class FakeAllocator:
    """Serves readings in order; empty_cache gives the unused reserved memory back."""

    def __init__(self, *readings: Reading) -> None:
        self.readings = list(readings)
        self.current = self.readings.pop(0)
        self.reads = 0
        self.emptied = 0

    def read(self) -> Reading:
        self.reads += 1
        reading = self.current
        if self.readings:
            self.current = self.readings.pop(0)
        return reading

    def empty_cache(self) -> None:
        self.emptied += 1
        self.current = Reading(self.current.allocated, self.current.allocated,
                               self.current.peak)


class FakeCounter:
    def __init__(self) -> None:
        self.value = 0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class FakeReport:
    def __init__(self) -> None:
        self.empty_cache = FakeCounter()
        self.reported: list[tuple] = []

    def device_memory(self, allocated, reserved, peak, fragmentation) -> None:
        self.reported.append((allocated, reserved, peak, fragmentation))


@pytest.mark.parametrize("allocated,reserved,fragmentation", [
    (100, 100, 0.0), (70, 100, 0.3), (0, 100, 1.0), (0, 0, 0.0), (25 * MiB, 100 * MiB, 0.75)])
def test_fragmentation_is_unused_share_of_reserved(allocated, reserved, fragmentation):
    assert Reading(allocated, reserved, allocated).fragmentation == pytest.approx(fragmentation)


@pytest.mark.parametrize("allocated,reserved,threshold,empty", [
    (69, 100, 0.3, True),     # 0.31 > 0.3
    (70, 100, 0.3, False),    # exactly the threshold: not above it
    (100, 100, 0.3, False),
    (0, 0, 0.3, False),       # nothing reserved: nothing to give back
    (0, 100, 1.0, False),     # a threshold of 1 never empties
    (90, 100, 0.05, True),
])
def test_policy(allocated, reserved, threshold, empty):
    assert should_empty_cache(Reading(allocated, reserved, allocated), threshold) is empty


def test_checks_every_n_batches_and_empties_above_the_threshold():
    fragmented = Reading(40 * MiB, 100 * MiB, 90 * MiB)  # 0.6
    allocator = FakeAllocator(fragmented)
    report = FakeReport()
    care = MemoryCare(allocator, report, every_batches=3, interval_s=60, threshold=0.3)
    care.after_batch(0.0)
    care.after_batch(0.1)
    assert allocator.reads == 0 and report.reported == []
    care.after_batch(0.2)  # the third batch: a check
    assert allocator.emptied == 1 and care.emptied == 1 and report.empty_cache.value == 1
    # What is reported is what remains after emptying.
    assert report.reported == [(40 * MiB, 40 * MiB, 90 * MiB, 0.0)]
    for t in range(3):
        care.after_batch(1.0 + t)
    assert allocator.emptied == 1  # no longer fragmented
    assert report.reported[-1] == (40 * MiB, 40 * MiB, 90 * MiB, 0.0)


def test_below_the_threshold_nothing_is_emptied():
    allocator = FakeAllocator(Reading(80 * MiB, 100 * MiB, 80 * MiB))
    report = FakeReport()
    care = MemoryCare(allocator, report, every_batches=1, interval_s=60, threshold=0.3)
    care.after_batch(0.0)
    assert allocator.emptied == 0 and report.empty_cache.value == 0
    assert report.reported == [(80 * MiB, 100 * MiB, 80 * MiB, pytest.approx(0.2))]


def test_idle_checks_at_most_once_per_interval():
    allocator = FakeAllocator(Reading(10, 10, 10))
    care = MemoryCare(allocator, FakeReport(), every_batches=100, interval_s=0.5, threshold=0.3)
    care.idle(10.0)
    care.idle(10.2)
    care.idle(10.49)
    assert allocator.reads == 1
    care.idle(10.5)
    assert allocator.reads == 2
    care.after_batch(10.6)  # a batch does not reset the idle clock; a check does
    care.idle(10.9)
    assert allocator.reads == 2


def test_on_the_cpu_checks_are_skipped_cleanly():
    torch = pytest.importorskip("torch")
    allocator = TorchAllocator(torch.device("cpu"))
    report = FakeReport()
    care = MemoryCare(allocator, report, every_batches=1, interval_s=0, threshold=0.0)
    assert allocator.read() is None
    assert care.check(0.0) is None
    care.after_batch(1.0)
    care.idle(2.0)
    assert report.reported == [] and report.empty_cache.value == 0 and care.emptied == 0


def test_worker_metrics_report_readings_as_gauges():
    worker = WorkerMetrics(91)  # an index no other test uses: the registry is process-wide
    care = MemoryCare(FakeAllocator(Reading(30 * MiB, 100 * MiB, 64 * MiB)), worker,
                      every_batches=1, interval_s=60, threshold=0.5)
    care.after_batch(0.0)

    def value(name):
        return REGISTRY.get_sample_value(name, {"worker": "91"})
    assert value("shmserve_worker_device_allocated_bytes") == 30 * MiB
    assert value("shmserve_worker_device_reserved_bytes") == 30 * MiB  # emptied: 0.7 > 0.5
    assert value("shmserve_worker_device_peak_allocated_bytes") == 64 * MiB
    assert value("shmserve_worker_device_fragmentation_ratio") == 0.0
    assert value("shmserve_worker_empty_cache_total") == 1
