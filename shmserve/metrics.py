"""Prometheus plumbing every process shares: buckets, a bulk observe, the scrape-time registry,
and the bookkeeping for processes that exit.

The metrics themselves live beside the code that observes them (`frontend.metrics`,
`gpu_workers.metrics`); all names start with ``shmserve_``.

Multiprocess mode (prometheus_client): supervisord sets PROMETHEUS_MULTIPROC_DIR for every
program and `shmserve up` empties it. Each process writes its values into files named after its
pid; a scrape (any frontend's GET /metrics) sums them:
  * counters and histograms of exited processes stay: what they counted happened, so totals
    survive restarts and nothing is counted twice (a restarted process has a new pid, new files);
    so do "max" gauges (a last inference's time). `metrics_files.mark_dead` merges them into
    one file of each kind (`counter_archive.db`, `histogram_archive.db`,
    `gauge_max_archive.db`): every scrape read every file any process ever wrote, and a crash
    loop's thousands of them took a scrape past nginx's timeout (an outside check);
  * other gauges are "live" and their files are removed when their process exits (the same
    `mark_dead`, run by `shmserve.reaper` on supervisord's process events), so a killed
    worker's queue depth or in-flight count never lingers nor adds to its successor's.
Resident memory is not written by anyone: it is read at scrape time for every process
supervisord runs (`shmserve.processes`), so it covers nginx and supervisord too.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client import multiprocess
from prometheus_client import values as prometheus_values
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from shmserve.metrics_files import ReservedMmapedDict, scrape_lock

# Seconds, as Prometheus prefers, from 0.1 ms (tokenizing a short text) to 120 s.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02,
                   0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0,
                   60.0, 120.0)  # (deadlines run to nginx's 120 s)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKEN_BUCKETS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
RATIO_BUCKETS = (1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.75, 2.0, 3.0, 5.0, 10.0)

_FEW = 4  # observe_many: up to this many values, one observe each (1.6 us against 8 us)

# Families no scrape shows: Triton's statistics extension reads them (frontend.stats). They say
# what the histograms at /metrics say, by revision and batch size, which there would only add
# series (a batch size's, up to max_batch_size of them a model).
HIDDEN_PREFIX = "shmserve_stats_"


def observe_many(histogram, values: np.ndarray | list[float]) -> None:
    """Observe every value of `values` (one-dimensional) in one labelled histogram child, in a
    few file writes.

    prometheus_client has no bulk observe; one `observe` per value costs a lock and two mmap
    writes each, which adds up for hundreds of texts. This increments each bucket once by its
    count (the same buckets `observe` would pick: the first upper bound >= value) and the sum
    once. tests/unit/test_metrics.py checks it against `observe` on this prometheus_client.
    """
    if len(values) <= _FEW:  # numpy's fixed cost is more than a few plain observes
        for value in values:
            histogram.observe(float(value))
        return
    values = np.asarray(values, dtype=np.float64)
    bounds = np.asarray(histogram._upper_bounds, dtype=np.float64)
    counts = np.bincount(np.searchsorted(bounds, values, side="left"), minlength=bounds.size)
    for bucket, count in zip(histogram._buckets, counts.tolist()):
        if count:
            bucket.inc(count)
    histogram._sum.inc(float(values.sum()))


class Turn:
    """Metric updates made during one turn of the event loop, written when the turn ends.

    In multiprocess mode every `inc` or `observe` takes a lock, checks the pid (a system call)
    and writes the mmap'd file, ~0.9 us for a counter and ~2 us for a histogram; a request
    makes about twenty. A frontend answers many requests a turn (a worker's replies for it
    arrive as one message), so the same few children are written over and over. Here they are
    summed (counters, gauges: the net change) or collected (histograms: one `observe_many`)
    and written once, by a callback the loop runs right after the turn. Outside a running
    loop (a script, a test) updates are written at once."""

    __slots__ = ("_added", "_observed", "_pending", "_deferred")

    def __init__(self) -> None:
        self._added: dict[object, float] = {}
        self._observed: dict[object, list[float]] = {}
        self._pending = False
        self._deferred: list[Callable[[], None]] = []

    def defer(self, write: Callable[[], None]) -> None:
        """Call `write` when the turn's updates are written (once, however often deferred in
        the turn): a tally of its own (frontend.metrics.StatsTally) writes itself then."""
        if write not in self._deferred:
            self._deferred.append(write)
        self._schedule()

    def add(self, child, amount: float) -> None:
        self._added[child] = self._added.get(child, 0.0) + amount
        self._schedule()

    def observe(self, child, values: list[float]) -> None:
        held = self._observed.get(child)
        if held is None:
            self._observed[child] = values
        else:
            held.extend(values)
        self._schedule()

    def _schedule(self) -> None:
        if self._pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._pending = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write what is held (the loop's callback; also a frontend's shutdown and scrape)."""
        self._pending = False
        added, self._added = self._added, {}
        observed, self._observed = self._observed, {}
        for child, amount in added.items():
            if amount:
                child.inc(amount)
        for child, values in observed.items():
            observe_many(child, values)
        deferred, self._deferred = self._deferred, []
        for write in deferred:
            write()


class _Held:
    """A metric child whose updates go through a `Turn`: what `Children(metric, turn)` gives."""

    __slots__ = ("_child", "_turn")

    def __init__(self, child, turn: Turn) -> None:
        self._child, self._turn = child, turn

    def inc(self, amount: float = 1.0) -> None:
        self._turn.add(self._child, amount)

    def dec(self, amount: float = 1.0) -> None:
        self._turn.add(self._child, -amount)

    def observe(self, value: float) -> None:
        self._turn.observe(self._child, [value])

    def observe_many(self, values: list[float]) -> None:
        self._turn.observe(self._child, list(values))


class Children:
    """A labelled metric's children, cached by label values; with a `turn`, their updates are
    held until the event loop's turn ends (see `Turn`).

    prometheus_client's `labels()` validates its arguments and takes a lock on every call
    (~0.9 us here); a request path that labels eleven children per request looks them up here
    instead. Label values must already be strings, and few (routes, models, statuses)."""

    __slots__ = ("_metric", "_cache", "_turn", "_lost")

    def __init__(self, metric, turn: Turn | None = None) -> None:
        self._metric = metric
        self._cache: dict[tuple[str, ...], object] = {}
        self._turn = turn
        self._lost = False  # an update was lost (logged once)

    def __call__(self, *values: str):
        child = self._cache.get(values)
        if child is None:
            try:
                child = self._metric.labels(*values)
            except OSError as exc:  # its file could not grow (a full run directory): the
                # update is lost, not the request (every request of a frontend was a 500)
                if not self._lost:
                    self._lost = True
                    logging.getLogger("shmserve.metrics").warning(
                        "metrics.update_lost", extra={"fields": {
                            "metric": self._metric._name, "reason": str(exc)}})
                return _LOST
            if self._turn is not None:
                child = _Held(child, self._turn)
            self._cache[values] = child
        return child


class _Lost:
    """A child whose file could not be written: its updates are dropped."""

    def inc(self, amount: float = 1) -> None:
        pass

    dec = set = observe = inc


_LOST = _Lost()


# Every value a process's metrics create opens its file through this name (values.py).
prometheus_values.MmapedDict = ReservedMmapedDict


def multiproc_dir() -> Path | None:
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    return Path(path) if path else None


def registry(extra: Iterable[Collector] = (), workers: Iterable[str] = (),
             lost: Iterable[str] = ()) -> CollectorRegistry:
    """What a scrape reads: every process's files (multiprocess mode), else this process's own
    metrics (a frontend run by hand, a test), plus `extra` collectors. `workers`: the
    configured workers' indexes, each with a shmserve_worker_ready series (0 where none runs);
    `lost`: those the scraped frontend has lost (silent, hung: ready 0, whatever their own
    gauge last said)."""
    directory = multiproc_dir()
    if directory is not None:
        source = multiprocess.MultiProcessCollector(None, path=str(directory))
    else:
        from prometheus_client import REGISTRY

        source = REGISTRY
    reg = CollectorRegistry()
    reg.register(_Delegate(source, tuple(workers), directory, frozenset(lost)))
    for collector in extra:
        reg.register(collector)
    return reg


def hidden_samples() -> list[Sample]:
    """The samples of the families no scrape shows (HIDDEN_PREFIX), summed over every process
    as a scrape sums them; blocking (files): run it off the event loop."""
    directory = multiproc_dir()
    if directory is None:
        from prometheus_client import REGISTRY

        families = REGISTRY.collect()
    else:
        with scrape_lock(directory):
            families = list(multiprocess.MultiProcessCollector(None, path=str(directory))
                            .collect())
    return [sample for family in families if family.name.startswith(HIDDEN_PREFIX)
            for sample in family.samples]


def exposition(extra: Iterable[Collector] = (), workers: Iterable[str] = (),
               lost: Iterable[str] = ()) -> tuple[bytes, str]:
    return generate_latest(registry(extra, workers, lost)), CONTENT_TYPE_LATEST


class ResidentMemory(Collector):
    """``shmserve_process_resident_memory_bytes{program}``, read when scraped.

    `read` returns program -> bytes (children included: nginx's workers count as nginx)."""

    def __init__(self, read: Callable[[], Mapping[str, int]]) -> None:
        self._read = read

    def collect(self):
        family = GaugeMetricFamily("shmserve_process_resident_memory_bytes",
                                   "Resident memory of each process supervisord runs, with its "
                                   "children, read at scrape time", labels=["program"])
        for program, rss in sorted(self._read().items()):
            family.add_metric([program], float(rss))
        yield family


class OpenFiles(Collector):
    """``shmserve_process_open_fds{program}`` and ``shmserve_process_max_fds{program}``, read
    when scraped: per program, its process nearest its open-files limit (`read` returns
    program -> (open, soft limit): shmserve.processes.open_files)."""

    def __init__(self, read: Callable[[], Mapping[str, tuple[int, int]]]) -> None:
        self._read = read

    def collect(self):
        used = GaugeMetricFamily("shmserve_process_open_fds", "Open file descriptors of each "
                                 "program's process nearest its limit, read at scrape time",
                                 labels=["program"])
        most = GaugeMetricFamily("shmserve_process_max_fds", "That process's open-files limit "
                                 "(soft): at it, connections fail quietly", labels=["program"])
        for program, (n, limit) in sorted(self._read().items()):
            used.add_metric([program], float(n))
            most.add_metric([program], float(limit))
        yield used
        yield most


class Filesystems(Collector):
    """``shmserve_filesystem_avail_bytes{volume}`` and ``shmserve_filesystem_size_bytes{volume}``,
    read when scraped (statvfs) for each of `volumes` (name -> path): the run directory, whose
    filling loses log lines and metrics updates, and /dev/shm, whose filling refuses requests
    (503 shm_full). A path it cannot read is left out."""

    def __init__(self, volumes: Mapping[str, str]) -> None:
        self._volumes = volumes

    def collect(self):
        avail = GaugeMetricFamily("shmserve_filesystem_avail_bytes", "Bytes an unprivileged "
                                  "process may still write on the filesystem of each volume "
                                  "(run_dir, shm), read at scrape time", labels=["volume"])
        size = GaugeMetricFamily("shmserve_filesystem_size_bytes", "Size of that filesystem",
                                 labels=["volume"])
        for volume, path in sorted(self._volumes.items()):
            try:
                stat = os.statvfs(path)
            except OSError:
                continue
            avail.add_metric([volume], float(stat.f_bavail * stat.f_frsize))
            size.add_metric([volume], float(stat.f_blocks * stat.f_frsize))
        yield avail
        yield size


class _Delegate(Collector):
    """Lets a fresh registry serve `source`'s metrics (the default registry's, or every
    process's files) without re-registering them; with shmserve_worker_ready at 0 for each of
    `workers` no live process wrote it. A stopped worker's live gauge file goes with it (the
    reaper), and its series then vanished: a panel's line ended, and an alert on
    `shmserve_worker_ready == 0` never fired (an outside check). And at 0 for each of `lost`:
    a hung (or SIGSTOPped) worker's process lives, and so does its last word, 1, until it is
    killed (an outside check: 1 for ~30 s while /ready said the worker was lost)."""

    def __init__(self, source, workers: tuple[str, ...] = (),
                 directory: Path | None = None, lost: frozenset[str] = frozenset()) -> None:
        self._source = source
        self._workers = workers
        self._directory = directory  # multiprocess mode's: read under its lock (compact)
        self._lost = lost

    def collect(self):
        ready = None
        if self._directory is not None:
            with scrape_lock(self._directory):
                # prometheus_client's glob reads an unlistable directory (no file descriptor
                # left) as empty: every worker then read as not ready (an outside check)
                os.listdir(self._directory)
                families = list(self._source.collect())
        else:
            families = self._source.collect()
        for family in families:
            if family.name.startswith(HIDDEN_PREFIX):
                continue
            if family.name == READY:
                ready = family
            else:
                yield family
        if self._workers:  # when no worker runs at all, the family itself is made here
            ready = ready or GaugeMetricFamily(READY, "Multiprocess metric", labels=["worker"])
            have = {sample.labels.get("worker") for sample in ready.samples}
            ready.samples += [Sample(READY, {"worker": w}, 0.0)
                              for w in self._workers if w not in have]
        if ready is not None:
            if self._lost:
                ready.samples = [s._replace(value=0.0) if s.labels.get("worker") in self._lost
                                 else s for s in ready.samples]
            yield ready


READY = "shmserve_worker_ready"  # gpu_workers.metrics'
