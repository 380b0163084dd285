"""The workers' device memory policy against a fake allocator: no GPU, no model."""

from __future__ import annotations

import weakref

import pytest
from prometheus_client import REGISTRY

import numpy as np

from gpu_workers.memory import (MemoryCare, Policy, Reading, TorchAllocator, empty_reason,
                                forward_in_halves)
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
        """Gives back the unused whole blocks (not the split ones)."""
        self.emptied += 1
        c = self.current
        self.current = Reading(c.allocated, c.allocated + c.inactive_split, c.peak,
                               c.inactive_split, c.free + c.unused - c.inactive_split, c.total)


class FakeReport:
    def __init__(self) -> None:
        self.emptied_reasons: list[str] = []
        self.reported: list[Reading] = []

    def emptied(self, reason: str) -> None:
        self.emptied_reasons.append(reason)

    def device_memory(self, reading: Reading) -> None:
        self.reported.append(reading)


def reading(allocated_mib, reserved_mib, free_share=0.5, split_mib=0, peak_mib=None):
    """A reading of a 1,000 MiB device."""
    total = 1000 * MiB
    return Reading(allocated_mib * MiB, reserved_mib * MiB,
                   (peak_mib if peak_mib is not None else allocated_mib) * MiB,
                   split_mib * MiB, int(free_share * total), total)


def test_fragmentation_is_the_split_share_of_reserved():
    assert reading(100, 400, split_mib=100).fragmentation == pytest.approx(0.25)
    assert reading(100, 400).fragmentation == 0.0  # unused but whole: empty_cache returns it
    assert Reading(0, 0, 0).fragmentation == 0.0
    assert reading(100, 400).unused == 300 * MiB
    assert Reading(0, 0, 0).free_share == 1.0  # total unknown: never "short of memory"


POLICY = Policy(idle_s=30, free_below=0.05)


@pytest.mark.parametrize("r,idle_for,reason", [
    (reading(100, 900), 0.0, None),               # busy, a warm cache, room on the device: keep
    (reading(100, 900, free_share=0.04), 0.0, "pressure"),
    (reading(100, 150, free_share=0.01), 0.0, None),  # 50 MiB unused: not worth the round trip
    (reading(100, 900), 29.9, None),
    (reading(100, 900), 30.0, "idle"),
    (reading(100, 900, free_share=0.01), 60.0, "pressure"),
])
def test_policy(r, idle_for, reason):
    assert empty_reason(r, idle_for, POLICY) == reason


def test_zero_turns_each_rule_off():
    r = reading(100, 900, free_share=0.0)
    assert empty_reason(r, 1e9, Policy(idle_s=0, free_below=0)) is None


def test_a_busy_worker_keeps_its_cache():
    """The old policy's failure: between passes every activation is free, so unused / reserved
    is high on any busy worker; that alone must not empty the cache."""
    allocator = FakeAllocator(reading(100, 900))  # 0.89 of reserved unused
    report = FakeReport()
    care = MemoryCare(allocator, report, every_batches=2, interval_s=0.5, policy=POLICY)
    for t in range(200):
        care.after_batch(t * 0.01)
    assert allocator.reads == 100 and allocator.emptied == 0
    assert report.reported[-1] == reading(100, 900)


def test_pressure_empties_at_a_check_and_reports_what_remains():
    allocator = FakeAllocator(reading(100, 900, free_share=0.02))
    report = FakeReport()
    care = MemoryCare(allocator, report, every_batches=3, interval_s=60, policy=POLICY)
    care.after_batch(0.0)
    care.after_batch(0.1)
    assert allocator.reads == 0 and report.reported == []
    care.after_batch(0.2)  # the third batch: a check
    assert allocator.emptied == 1 and care.emptied == 1 and report.emptied_reasons == ["pressure"]
    assert report.reported == [allocator.current] and allocator.current.reserved == 100 * MiB
    for t in range(3):
        care.after_batch(1.0 + t)
    assert allocator.emptied == 1  # nothing left to give back


def test_idle_empties_once_per_idle_spell():
    allocator = FakeAllocator(reading(100, 900))
    report = FakeReport()
    care = MemoryCare(allocator, report, every_batches=100, interval_s=0.5, policy=POLICY)
    care.after_batch(0.0)
    for t in range(1, 60):  # idle checks twice a second for 30 s
        care.idle(t * 0.5)
    assert allocator.emptied == 0  # 29.5 s idle
    care.idle(30.0)
    assert report.emptied_reasons == ["idle"]
    allocator.current = reading(100, 900)  # say the allocator keeps what it cannot return
    for t in range(61, 100):
        care.idle(t * 0.5)
    assert report.emptied_reasons == ["idle"]  # once a spell
    care.after_batch(50.0)  # traffic again, then idle again
    care.idle(80.0)
    assert report.emptied_reasons == ["idle", "idle"]


def test_a_worker_idle_since_start_counts_from_its_first_check():
    allocator = FakeAllocator(reading(100, 900))
    care = MemoryCare(allocator, FakeReport(), every_batches=100, interval_s=0.5, policy=POLICY)
    care.idle(1000.0)  # just loaded: its warm-up cache is kept
    assert allocator.emptied == 0
    care.idle(1029.0)
    assert allocator.emptied == 0
    care.idle(1030.0)
    assert allocator.emptied == 1


def test_idle_checks_at_most_once_per_interval():
    allocator = FakeAllocator(reading(10, 10))
    care = MemoryCare(allocator, FakeReport(), every_batches=100, interval_s=0.5, policy=POLICY)
    care.idle(10.0)
    care.idle(10.2)
    care.idle(10.49)
    assert allocator.reads == 1
    care.idle(10.5)
    assert allocator.reads == 2
    care.after_batch(10.6)  # a batch does not reset the idle clock; a check does
    care.idle(10.9)
    assert allocator.reads == 2


def test_after_oom_empties_whatever_the_policy_says():
    allocator = FakeAllocator(reading(100, 900))
    report = FakeReport()
    care = MemoryCare(allocator, report, every_batches=100, interval_s=60,
                      policy=Policy(idle_s=0, free_below=0))
    care.after_oom()
    assert allocator.emptied == 1 and report.emptied_reasons == ["oom"]


def test_on_the_cpu_checks_are_skipped_cleanly():
    torch = pytest.importorskip("torch")
    allocator = TorchAllocator(torch.device("cpu"))
    report = FakeReport()
    care = MemoryCare(allocator, report, every_batches=1, interval_s=0,
                      policy=Policy(idle_s=0.001, free_below=1.0))
    assert allocator.read() is None
    assert care.check(0.0) is None
    care.after_batch(1.0)
    care.idle(2.0)
    care.after_oom()
    assert report.reported == [] and report.emptied_reasons == [] and care.emptied == 0


def test_worker_metrics_report_readings_as_gauges():
    worker = WorkerMetrics(91)  # an index no other test uses: the registry is process-wide
    care = MemoryCare(FakeAllocator(reading(300, 1000, free_share=0.01, split_mib=20,
                                            peak_mib=640)),
                      worker, every_batches=1, interval_s=60, policy=POLICY)
    care.after_batch(0.0)

    def value(name, **labels):
        return REGISTRY.get_sample_value(name, {"worker": "91", **labels})
    assert value("shmserve_worker_device_allocated_bytes") == 300 * MiB
    # Emptied (pressure): what remains is the tensors and the split blocks beside them.
    assert value("shmserve_worker_device_reserved_bytes") == 320 * MiB
    assert value("shmserve_worker_device_peak_allocated_bytes") == 640 * MiB
    assert value("shmserve_worker_device_free_bytes") == 10 * MiB + 680 * MiB
    assert value("shmserve_worker_device_fragmentation_ratio") == pytest.approx(20 / 320)
    assert value("shmserve_worker_empty_cache_total", reason="pressure") == 1
    assert value("shmserve_worker_empty_cache_total", reason="idle") == 0


# ---- a pass that runs out of memory ---------------------------------------------------------

def group(lengths, segments=False):
    lengths = np.array(lengths, np.int64)
    ids = np.zeros((len(lengths), int(lengths.max())), np.int64)
    for j, n in enumerate(lengths):
        ids[j, :n] = 1000 + n  # each row's token says its length
    return ids, lengths, (lengths % 2 if segments else None)


class SmallDevice:
    """A forward that runs out of memory above `budget` padded tokens; each row's output is its
    text's length (read back from its tokens) and its padded width, so a row that got another
    text's output, or padding not cut to its own rows, shows."""

    def __init__(self, budget, error=None):
        self.budget = budget
        self.error = error or (lambda: torch.OutOfMemoryError("CUDA out of memory (test)"))
        self.calls = []

    def __call__(self, groups):
        padded = sum(ids.shape[0] * ids.shape[1] for ids, _, _ in groups)
        self.calls.append(padded)
        if padded > self.budget:
            raise self.error()
        return np.concatenate([np.stack([ids[:, 0] - 1000, np.full(len(ids), ids.shape[1]),
                                         lengths], axis=1) for ids, lengths, _ in groups]
                              ).astype(np.float32)


torch = pytest.importorskip("torch")


def test_a_pass_that_fits_runs_once_without_a_copy():
    device = SmallDevice(budget=10_000)
    groups = [group([5, 7, 6]), group([30, 31])]
    oom = []
    rows, ok = forward_in_halves(device, groups, lambda: oom.append(1))
    assert ok == [True] * 5 and oom == [] and len(device.calls) == 1
    assert rows[:, 0].tolist() == [5, 7, 6, 30, 31]


def test_out_of_memory_halves_the_pass_until_it_fits():
    device = SmallDevice(budget=64)
    groups = [group([5, 7, 6, 8]), group([30, 31])]  # 32 + 62 padded tokens
    oom = []
    rows, ok = forward_in_halves(device, groups, lambda: oom.append(1))
    assert ok == [True] * 6
    assert rows[:, 0].tolist() == [5, 7, 6, 8, 30, 31]  # in order, each its own
    assert rows[:, 2].tolist() == rows[:, 0].tolist()
    # The second group, 2 x 31 = 62 tokens, fits once split off; the empty cache is asked for
    # at every failure.
    assert device.calls == [94, 32, 62] and len(oom) == 1


def test_a_split_group_is_cut_to_its_own_longest_text():
    device = SmallDevice(budget=100)
    rows, ok = forward_in_halves(device, [group([4, 6, 50, 5])], lambda: None)
    assert ok == [True] * 4
    assert rows[:, 0].tolist() == [4, 6, 50, 5]
    assert rows[:, 1].tolist() == [6, 6, 50, 50]  # halves of 2 rows, padded to 6 and 50


def test_one_text_too_large_fails_alone():
    device = SmallDevice(budget=40)
    rows, ok = forward_in_halves(device, [group([5, 7, 90, 6]), group([3])], lambda: None)
    assert ok == [True, True, False, True, True]
    assert rows[:, 0].tolist() == [5, 7, 0, 6, 3]  # the failed row is zeros


def test_every_text_too_large():
    rows, ok = forward_in_halves(SmallDevice(budget=1), [group([5, 7])], lambda: None)
    assert rows is None and ok == [False, False]
    rows, ok = forward_in_halves(SmallDevice(budget=1), [group([5])], lambda: None)
    assert rows is None and ok == [False]


def test_pairs_keep_their_segments_when_split():
    seen = []

    def forward(groups):
        if sum(len(g[1]) for g in groups) > 1:
            raise torch.OutOfMemoryError("test")
        seen.extend(int(s) for _, _, segments in groups for s in segments)
        return np.zeros((1, 1), np.float32)
    forward_in_halves(forward, [group([3, 4, 5, 6], segments=True)], lambda: None)
    assert seen == [1, 0, 1, 0]


def test_cpu_allocator_failures_count_as_out_of_memory_and_other_errors_do_not():
    cpu = SmallDevice(budget=10, error=lambda: RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"))
    _, ok = forward_in_halves(cpu, [group([4, 4, 4, 4])], lambda: None)
    assert ok == [True] * 4
    broken = SmallDevice(budget=10, error=lambda: RuntimeError("shape mismatch"))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        forward_in_halves(broken, [group([4, 4, 4, 4])], lambda: None)
    assert broken.calls == [16]  # not retried: only memory is worth a smaller pass


def test_a_reload_that_empties_the_cache_is_counted(monkeypatch):
    # The worker's release after a hot reload or unload: on a GPU it empties the cache, and
    # says so with reason "reload"; on the CPU it only collects.
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from gpu_workers.worker import Worker

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    metrics = WorkerMetrics(92)

    def count():
        return REGISTRY.get_sample_value("shmserve_worker_empty_cache_total",
                                         {"worker": "92", "reason": "reload"})
    Worker._release(SimpleNamespace(device=torch.device("cpu"), metrics=metrics))
    assert calls == [] and count() == 0
    Worker._release(SimpleNamespace(device=torch.device("cuda"), metrics=metrics))
    assert calls == [1] and count() == 1


def test_per_token_rows_keep_their_texts_places_when_halved():
    """A per-token pass (TEI's /embed_all) gives a row for every token: halves and a failed
    text's zeros must take that many rows, so every later text's rows stay in place."""

    def forward(groups):
        padded = sum(ids.shape[0] * ids.shape[1] for ids, _, _ in groups)
        if padded > 40:
            raise torch.OutOfMemoryError("test")
        return np.concatenate([ids[j, :n, None] - 1000.0 for ids, lengths, _ in groups
                               for j, n in enumerate(lengths)]).astype(np.float32)

    rows, ok = forward_in_halves(forward, [group([5, 7, 90, 6]), group([3])], lambda: None,
                                 per_token=True)
    assert ok == [True, True, False, True, True]
    assert rows[:, 0].tolist() == [5] * 5 + [7] * 7 + [0] * 90 + [6] * 6 + [3] * 3


def test_the_failed_pass_is_released_before_the_cache_is_emptied_and_the_halves_run():
    """Inside the except block the traceback holds the failed forward's frame and its tensors:
    emptying the cache there gives nothing back, and the halves run beside them."""
    passes = []  # a weak reference to each pass's activations

    class Activations:
        pass

    def forward(groups):
        activations = Activations()  # what the failed pass's frame holds
        passes.append(weakref.ref(activations))
        if sum(len(lengths) for _, lengths, _ in groups) > 1:
            raise torch.OutOfMemoryError("test")
        return np.zeros((1, 1), np.float32)

    alive_at_oom = []
    forward_in_halves(forward, [group([3, 4, 5, 6])],
                      lambda: alive_at_oom.append(sum(p() is not None for p in passes)))
    assert len(alive_at_oom) == 3  # the pass of 4, then each half of 2
    assert alive_at_oom == [0, 0, 0]


def test_a_cuda_error_that_says_out_of_memory_is_out_of_memory():
    cublas = SmallDevice(budget=10, error=lambda: torch.AcceleratorError(
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"))
    _, ok = forward_in_halves(cublas, [group([4, 4, 4, 4])], lambda: None)
    assert ok == [True] * 4 and cublas.calls == [16, 8, 8]
    illegal = SmallDevice(budget=10, error=lambda: torch.AcceleratorError(
        "CUDA error: an illegal memory access was encountered"))
    with pytest.raises(torch.AcceleratorError):
        forward_in_halves(illegal, [group([4, 4, 4, 4])], lambda: None)
