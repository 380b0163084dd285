"""shmserve.metrics without a stack: bulk observe, the dead-process sweep, the scrape registry."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.parser import text_string_to_metric_families

from shmserve import metrics, metrics_files


def samples(registry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if not s.name.endswith("_created")}


@pytest.mark.parametrize("values", [
    [], [0], [4, 4, 4], [1, 3, 4, 5, 64, 65, 10**6], np.arange(0, 3000, 7), [0.5, 1.0, 1.05],
])
def test_observe_many_equals_one_observe_per_value(values):
    bulk_reg, one_reg = CollectorRegistry(), CollectorRegistry()
    buckets = metrics.TOKEN_BUCKETS + metrics.RATIO_BUCKETS[:3]
    bulk = Histogram("h", "h", ["m"], buckets=sorted(set(buckets)), registry=bulk_reg)
    one = Histogram("h", "h", ["m"], buckets=sorted(set(buckets)), registry=one_reg)
    metrics.observe_many(bulk.labels("x"), np.asarray(values))
    child = one.labels("x")
    for v in values:
        child.observe(float(v))
    assert samples(bulk_reg) == samples(one_reg)


def test_buckets_suit_milliseconds():
    assert metrics.LATENCY_BUCKETS[0] <= 0.0001 and 0.001 in metrics.LATENCY_BUCKETS
    assert list(metrics.LATENCY_BUCKETS) == sorted(metrics.LATENCY_BUCKETS)
    assert metrics.RATIO_BUCKETS[0] == 1.0  # padded / real is never below one


WRITER = ("import os, sys\n"
          "from prometheus_client import Counter, Gauge, Histogram\n"
          "n = int(sys.argv[1])\n"
          "c = Counter('t_requests', 'r', ['route'])\n"
          "c.labels('/a').inc(n)\n"
          "c.labels(f'/r{n}').inc()\n"
          "h = Histogram('t_seconds', 's', buckets=(0.1, 1.0))\n"
          "for v in (0.05, 0.5, 5.0)[:n]: h.observe(v)\n"
          "Gauge('t_inflight', 'i', multiprocess_mode='livesum').set(n)\n"
          "Gauge('t_last', 'l', multiprocess_mode='max').set(10 * n)\n"
          "Counter('shmserve_stats_t', 'hidden').inc(n)\n"
          "print(os.getpid())\n")


def dead_writers(directory, *counts, writer: str = WRITER) -> list[int]:
    """Processes that wrote counts into `directory` and exited: their pids."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    return [int(subprocess.run([sys.executable, "-c", writer, str(n)], env=env,
                               capture_output=True, text=True, check=True).stdout)
            for n in counts]


def scraped(directory, monkeypatch) -> dict[tuple[str, tuple], float]:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    return samples(metrics.registry())


def test_mark_dead_removes_dead_live_gauges_and_merges_their_counts(tmp_path, monkeypatch):
    """A dead process's live gauges go; its counters and histograms are merged into the
    archive files, and a scrape reads the same sums from them as from the files before."""
    # and one that only created a counter's series, as a removed program's exits are
    never = WRITER.split("c.labels")[0] + "c.labels('/never')\nprint(os.getpid())\n"
    pids = dead_writers(tmp_path, 1, 2) + dead_writers(tmp_path, 0, writer=never)
    gauge = (tmp_path / f"gauge_livesum_{pids[0]}.db").read_bytes()
    (tmp_path / f"gauge_livesum_{os.getpid()}.db").write_bytes(gauge)  # a live process's
    (tmp_path / "gauge_livesum_notapid.db").write_bytes(gauge)
    before = scraped(tmp_path, monkeypatch)
    assert before[("t_requests_total", (("route", "/a"),))] == 3.0
    assert sorted(metrics_files.mark_dead(tmp_path)) == sorted(pids)
    left = sorted(p.name for p in tmp_path.glob("*.db"))
    assert left == ["counter_archive.db", f"gauge_livesum_{os.getpid()}.db",
                    "gauge_livesum_notapid.db", "gauge_max_archive.db", "histogram_archive.db"]
    after = scraped(tmp_path, monkeypatch)
    assert after.pop(("t_inflight", ())) == 2.0  # the two copies of the live gauge
    # a counter no process counted, held by dead processes alone, goes (a program removed)
    never = ("t_requests_total", (("route", "/never"),))
    assert before.pop(never) == 0.0 and never not in after
    assert after == {k: v for k, v in before.items() if k[0] != "t_inflight"}
    assert after[("t_seconds_bucket", (("le", "1.0"),))] == 3.0  # cumulative
    assert after[("t_seconds_count", ())] == 3.0

    # a later death adds to the archive; a sweep with nothing dead changes nothing
    dead_writers(tmp_path, 3)
    assert metrics_files.mark_dead(tmp_path) and metrics_files.mark_dead(tmp_path) == []
    again = scraped(tmp_path, monkeypatch)
    assert again[("t_requests_total", (("route", "/a"),))] == 6.0
    assert again[("t_requests_total", (("route", "/r3"),))] == 1.0
    assert again[("t_seconds_bucket", (("le", "+Inf"),))] == 6.0
    assert again[("t_seconds_bucket", (("le", "0.1"),))] == 3.0
    assert before[("t_last", ())] == 20.0 and again[("t_last", ())] == 30.0  # the greatest
    assert sorted(p.name for p in tmp_path.glob("*.db")) == left


@pytest.mark.parametrize("step,nth", [("replace", n) for n in range(1, 10)]
                         + [("unlink", 1), ("unlink", 3)])
def test_a_merge_killed_part_way_is_finished_or_undone_by_the_next(tmp_path, monkeypatch,
                                                                   step, nth):
    """SIGKILLed between two of its steps (here: at its `nth` rename, of a file set aside or an
    archive replaced, or its `nth` removal of a file set aside), the next sweep's merge leaves
    every sum as it was: nothing counted twice, nothing lost."""
    import pathlib

    pids = dead_writers(tmp_path, 1, 2)
    before = {k: v for k, v in scraped(tmp_path, monkeypatch).items() if k[0] != "t_inflight"}
    calls = []

    def dying(real):
        def call(*args, **kwargs):
            calls.append(args)
            if len(calls) == nth:
                raise KeyboardInterrupt("killed")  # what SIGKILL leaves: the steps done so far
            return real(*args, **kwargs)
        return call
    with monkeypatch.context() as patched:
        if step == "replace":
            patched.setattr(metrics.os, "replace", dying(os.replace))
        else:
            patched.setattr(pathlib.Path, "unlink", dying(pathlib.Path.unlink))
        with pytest.raises(KeyboardInterrupt):
            metrics_files.compact(tmp_path, pids)
    metrics_files.mark_dead(tmp_path)  # the next sweep (the reaper, started again)
    assert scraped(tmp_path, monkeypatch) == before
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "counter_archive.db", "gauge_max_archive.db", "histogram_archive.db"]


def test_hidden_families_are_not_scraped_but_summed_for_the_statistics(tmp_path, monkeypatch):
    """shmserve_stats_* (Triton's statistics, frontend.stats) never reach a scrape; read for
    the statistics, they are summed over processes, dead ones merged included."""
    pids = dead_writers(tmp_path, 1, 2)
    assert not any(name.startswith("shmserve_stats_")
                   for name, _ in scraped(tmp_path, monkeypatch))

    def hidden() -> dict[str, float]:
        return {s.name: s.value for s in metrics.hidden_samples()}

    assert hidden() == {"shmserve_stats_t_total": 3.0}
    metrics_files.compact(tmp_path, pids)
    dead_writers(tmp_path, 4)
    assert hidden() == {"shmserve_stats_t_total": 7.0}


def test_a_merge_waits_for_the_scrape_reading(tmp_path, monkeypatch):
    """A scrape holds the directory's lock shared: a merge waits for it, so no scrape sees a
    file both merged and still there (counted twice) or listed and then gone (an error)."""
    import threading

    pid, = dead_writers(tmp_path, 2)
    done = threading.Event()
    with metrics_files.scrape_lock(tmp_path):
        merging = threading.Thread(target=lambda: (metrics_files.mark_dead(tmp_path), done.set()))
        merging.start()
        merging.join(0.5)
        assert not done.is_set() and (tmp_path / f"counter_{pid}.db").exists()
    merging.join(10)
    assert done.is_set() and not (tmp_path / f"counter_{pid}.db").exists()
    assert scraped(tmp_path, monkeypatch)[("t_requests_total", (("route", "/a"),))] == 2.0


def test_mark_dead_takes_named_pids_that_left_no_file(tmp_path):
    assert metrics_files.mark_dead(tmp_path, [2**22 + 12345]) == [2**22 + 12345]
    assert metrics_files.mark_dead(tmp_path, [os.getpid()]) == []


def test_resident_memory_collector_and_registry_without_multiproc_dir(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    reader = metrics.ResidentMemory(lambda: {"worker-0": 5 << 20, "nginx": 1 << 20})
    body, ctype = metrics.exposition([reader])
    assert ctype.startswith("text/plain")
    found = {(s.name, s.labels.get("program")): s.value
             for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    assert found[("shmserve_process_resident_memory_bytes", "worker-0")] == 5 << 20
    assert found[("shmserve_process_resident_memory_bytes", "nginx")] == 1 << 20


def test_registry_reads_every_process_file(tmp_path, monkeypatch):
    """Two processes write one counter and one live gauge; a scrape sums both, and after one is
    marked dead its gauge is gone and its count stays."""
    code = ("from prometheus_client import Counter, Gauge\n"
            "Counter('t_requests', 'r').inc(3)\n"
            "Gauge('t_inflight', 'i', multiprocess_mode='livesum').set(2)\n"
            "import os; print(os.getpid())\n")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    pids = [int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                               text=True, check=True).stdout) for _ in range(2)]
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))

    def read():
        body, _ = metrics.exposition()
        return {s.name: s.value for f in text_string_to_metric_families(body.decode())
                for s in f.samples}
    assert read() == {"t_requests_total": 6.0, "t_inflight": 4.0}
    assert sorted(metrics_files.mark_dead(tmp_path)) == sorted(pids)
    assert read() == {"t_requests_total": 6.0}


def test_a_lost_worker_scrapes_not_ready_whatever_its_own_gauge_says(tmp_path, monkeypatch):
    """A hung worker's process lives, and its live gauge with it: its last word, 1, was scraped
    until the watchdog killed it. The frontend answering the scrape names the workers it has
    lost; those read 0, the others as they wrote, and a worker no process wrote 0."""
    code = ("from prometheus_client import Gauge\n"
            "g = Gauge('shmserve_worker_ready', 'r', ['worker'], "
            "multiprocess_mode='livemostrecent')\n"
            "g.labels('0').set(1); g.labels('1').set(1)\n")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))

    def ready(lost):
        body, _ = metrics.exposition(workers=["0", "1", "2"], lost=lost)
        return {s.labels["worker"]: s.value
                for f in text_string_to_metric_families(body.decode()) for s in f.samples
                if s.name == "shmserve_worker_ready"}
    assert ready([]) == {"0": 1.0, "1": 1.0, "2": 0.0}
    assert ready(["1"]) == {"0": 1.0, "1": 0.0, "2": 0.0}
    assert ready(["2"]) == {"0": 1.0, "1": 1.0, "2": 0.0}


def test_a_switch_retires_the_old_series_under_its_own_dtype():
    """dtype auto may resolve differently for the old and the new weights (bf16, then fp32 when
    the new ones miss the probe's bound): each series keeps its own labels."""
    import dataclasses
    from pathlib import Path

    from prometheus_client import REGISTRY

    from gpu_workers.metrics import WorkerMetrics
    from shmserve.models import ModelSpec

    old = ModelSpec("sw", Path("/m"), "embedding", "mean", True, 8, 4, "bf16", "r1")
    new = dataclasses.replace(old, dtype="fp32", revision="r2")
    WorkerMetrics(7).model_switched("sw", old, new, "cpu")

    def value(revision, dtype):
        return REGISTRY.get_sample_value("shmserve_model_info", {
            "worker": "7", "model": "sw", "revision": revision, "dtype": dtype,
            "device": "cpu"})
    assert (value("r1", "bf16"), value("r2", "fp32")) == (0.0, 1.0)
    assert value("r1", "fp32") is None  # no made-up series for the old weights


class CountingChild:
    """Stands in for a prometheus_client child: records every write."""

    def __init__(self, child) -> None:
        self.child, self.writes = child, 0

    def inc(self, amount: float = 1.0) -> None:
        self.writes += 1
        self.child.inc(amount)

    def observe(self, value: float) -> None:
        self.writes += 1
        self.child.observe(value)

    @property
    def _upper_bounds(self):
        return self.child._upper_bounds

    @property
    def _buckets(self):
        return self.child._buckets

    @property
    def _sum(self):
        return self.child._sum


def held_and_direct(turn: metrics.Turn):
    """The same counter, gauge and histogram twice: once held by `turn`, once written at once."""
    regs, made = (CollectorRegistry(), CollectorRegistry()), []
    for reg in regs:
        made.append((Counter("c", "c", ["m"], registry=reg), Gauge("g", "g", ["m"], registry=reg),
                     Histogram("h", "h", ["m"], buckets=metrics.LATENCY_BUCKETS, registry=reg)))
    held = [metrics.Children(m, turn) for m in made[0]]
    return regs, held, made[1]


def test_turn_holds_updates_until_the_loop_turn_ends_and_writes_the_same_values():
    import asyncio

    turn = metrics.Turn()
    (held_reg, direct_reg), (c, g, h), (dc, dg, dh) = held_and_direct(turn)
    values = [0.0003 * i for i in range(40)]

    async def requests():
        for value in values:
            c("x").inc()
            g("x").inc()
            h("x").observe(value)
            h("x").observe_many([value, value * 2])
            c("y").inc(2.5)
        for _ in values[:10]:
            g("x").dec()
        held_during_turn = samples(held_reg)
        await asyncio.sleep(0)  # the turn ends; its callback writes
        await asyncio.sleep(0)
        return held_during_turn

    during = asyncio.run(requests())
    for value in values:
        dc.labels("x").inc()
        dg.labels("x").inc()
        dh.labels("x").observe(value)
        for v in (value, value * 2):
            dh.labels("x").observe(v)
        dc.labels("y").inc(2.5)
    for _ in values[:10]:
        dg.labels("x").dec()
    assert samples(held_reg) == samples(direct_reg)
    assert samples(held_reg)[("c_total", (("m", "x"),))] == 40
    assert samples(held_reg)[("g", (("m", "x"),))] == 30
    assert during[("c_total", (("m", "x"),))] == 0  # nothing written before the turn ended


def test_turn_writes_each_child_once_per_turn():
    import asyncio

    turn = metrics.Turn()
    counter = CountingChild(Counter("c", "c", registry=CollectorRegistry()))
    histogram = CountingChild(Histogram("h", "h", buckets=metrics.LATENCY_BUCKETS,
                                        registry=CollectorRegistry()))

    async def two_turns():
        for _ in range(30):
            turn.add(counter, 1.0)
            turn.observe(histogram, [0.004])
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        turn.add(counter, 1.0)
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    asyncio.run(two_turns())
    assert counter.writes == 2  # one per turn, not one per update
    assert counter.child._value.get() == 31
    assert histogram.child._sum.get() == pytest.approx(0.12)
    assert histogram.writes == 0  # 30 values: observe_many's bulk path, not 30 observes


def test_turn_outside_a_running_loop_writes_at_once():
    turn = metrics.Turn()
    (held_reg, _), (c, g, h), _ = held_and_direct(turn)
    c("x").inc()
    h("x").observe(0.01)
    g("x").dec(3)
    got = samples(held_reg)
    assert got[("c_total", (("m", "x"),))] == 1
    assert got[("h_count", (("m", "x"),))] == 1
    assert got[("g", (("m", "x"),))] == -3


def test_metrics_files_have_their_pages_reserved_as_they_grow(tmp_path, monkeypatch):
    """prometheus_client grows a process's file by truncate (sparse): on a full filesystem the
    first write to a new page killed the process with SIGBUS (the frontends crash-looped on a
    full run directory, an outside check). A process that imports shmserve.metrics reserves
    the pages; a full filesystem is an OSError where the file grows."""
    import errno

    code = ("import shmserve.metrics\nfrom prometheus_client import Counter\n"
            "c = Counter('t_many', 'm', ['key'])\n"
            "[c.labels(f'{i:06d}' * 8).inc() for i in range(12000)]\n")  # past 1 MiB
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    (written,) = tmp_path.glob("counter_*.db")
    stat = written.stat()
    # all allocated, from 64 KiB doubled as the library doubles it: 12,000 entries of ~88 bytes
    assert stat.st_size == 2 << 20 and stat.st_blocks * 512 >= stat.st_size
    small = tmp_path / "small.db"
    metrics_files.ReservedMmapedDict(str(small)).close()
    assert small.stat().st_size == metrics_files.RESERVED_START <= small.stat().st_blocks * 512

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(metrics.os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space left"):
        metrics_files.ReservedMmapedDict(str(tmp_path / "new.db"))


def test_a_metrics_file_that_cannot_grow_loses_the_update_not_the_request(tmp_path,
                                                                          monkeypatch, caplog):
    """On a full run directory a new label's child could not be created: every request of a
    frontend answered 500, and the empty files left by failed starts made /metrics 500 after
    the space came back (a second outside check)."""
    import errno

    from prometheus_client import Counter

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(metrics.os, "posix_fallocate", full)
    with pytest.raises(OSError):
        metrics_files.ReservedMmapedDict(str(tmp_path / "counter_1.db"))
    assert not (tmp_path / "counter_1.db").exists()  # no empty file for a scrape to choke on
    counter = Counter("t_lost", "l", ["k"], registry=None)
    cache = metrics.Children(counter)
    monkeypatch.setattr(counter, "labels", lambda *v: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    cache("a").inc()  # dropped, logged once
    cache("b").observe(1.0)
    assert [r.message for r in caplog.records].count("metrics.update_lost") == 1
