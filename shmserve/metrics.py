"""Prometheus plumbing every process shares: buckets, a bulk observe, the scrape-time registry,
and the bookkeeping for processes that exit.

The metrics themselves live beside the code that observes them (`frontend.metrics`,
`gpu_workers.metrics`); all names start with ``shmserve_``.

Multiprocess mode (prometheus_client): supervisord sets PROMETHEUS_MULTIPROC_DIR for every
program and `shmserve up` empties it. Each process writes its values into files named after its
pid; a scrape (any frontend's GET /metrics) sums them:
  * counters and histograms of exited processes stay: what they counted happened, so totals
    survive restarts and nothing is counted twice (a restarted process has a new pid, new files);
    so do "max" gauges (a last inference's time). `mark_dead` merges them into one file of
    each kind (`counter_archive.db`, `histogram_archive.db`, `gauge_max_archive.db`): every
    scrape read every file any process ever wrote, and a crash loop's thousands of them took
    a scrape past nginx's timeout (an outside check);
  * other gauges are "live" and their files are removed when their process exits
    (`mark_dead`, run by `shmserve.reaper` on supervisord's process events), so a killed
    worker's queue depth or in-flight count never lingers nor adds to its successor's.
Resident memory is not written by anyone: it is read at scrape time for every process
supervisord runs (`shmserve.processes`), so it covers nginx and supervisord too.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import signal
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client import mmap_dict, multiprocess
from prometheus_client import values as prometheus_values
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from shmserve import processes

# Seconds, as Prometheus prefers, from 0.1 ms (tokenizing a short text) to 120 s.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02,
                   0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0,
                   60.0, 120.0)  # (deadlines run to nginx's 120 s)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKEN_BUCKETS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
RATIO_BUCKETS = (1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.75, 2.0, 3.0, 5.0, 10.0)

_FEW = 4  # observe_many: up to this many values, one observe each (1.6 us against 8 us)

_LIVE_GAUGE_FILE = re.compile(r"^gauge_live[a-z]*_(\d+)\.db$")
# a process's counts, and its highest values (merged: summed, or the greatest kept)
_KEPT_FILE = re.compile(r"^(counter|histogram|gauge_max)_(\d+)\.db$")
_KEPT_KINDS = {"counter": sum, "histogram": sum, "gauge_max": max}  # kind -> how it merges

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


class ReservedMmapedDict(mmap_dict.MmapedDict):
    """prometheus_client's per-process metrics file with its pages allocated (fallocate) as
    the file grows. The library grows it with truncate, which leaves it sparse, and the first
    write to a page that a full filesystem cannot give kills the process with SIGBUS: on a full
    run directory every frontend crash-looped, idle, while nginx answered 502 (an outside
    check). Reserved, a full filesystem raises OSError (ENOSPC) where the file grows instead:
    at a process's start an error in its log, later a new label's child not created (its
    update lost, `Children` logs it) while the process goes on serving. A new file starts at
    RESERVED_START, not the library's sparse 1 MiB, and doubles as the library doubles it: a
    dead process's counter and histogram files are kept (see mark_dead), and a crash loop's
    would otherwise each take whole mebibytes of the run directory."""

    def __init__(self, filename, read_mode=False):
        if not read_mode:  # before the library's first write (its header)
            fd, size = os.open(filename, os.O_RDWR | os.O_CREAT, 0o666), 0
            try:
                size = os.fstat(fd).st_size
                os.posix_fallocate(fd, 0, size or RESERVED_START)
            except OSError:
                if not size:  # an empty file made here: a scrape could not read it (a 500)
                    os.unlink(filename)
                raise
            finally:
                os.close(fd)
        super().__init__(filename, read_mode)

    def _init_value(self, key):
        need = self._used + len(key.encode("utf-8")) + 32  # the library's entry, at most
        capacity = self._capacity
        while need > capacity:
            capacity *= 2
        if capacity > self._capacity:  # the library doubles it by truncate: reserve first
            os.posix_fallocate(self._f.fileno(), 0, capacity)
        super()._init_value(key)


RESERVED_START = 64 << 10  # bytes: a process's file of one kind of metric, to begin with


# Every value a process's metrics create opens its file through this name (values.py).
prometheus_values.MmapedDict = ReservedMmapedDict


def multiproc_dir() -> Path | None:
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    return Path(path) if path else None


def registry(extra: Iterable[Collector] = (), workers: Iterable[str] = ()) -> CollectorRegistry:
    """What a scrape reads: every process's files (multiprocess mode), else this process's own
    metrics (a frontend run by hand, a test), plus `extra` collectors. `workers`: the
    configured workers' indexes, each with a shmserve_worker_ready series (0 where none runs)."""
    directory = multiproc_dir()
    if directory is not None:
        source = multiprocess.MultiProcessCollector(None, path=str(directory))
    else:
        from prometheus_client import REGISTRY

        source = REGISTRY
    reg = CollectorRegistry()
    reg.register(_Delegate(source, tuple(workers), directory))
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


def exposition(extra: Iterable[Collector] = (),
               workers: Iterable[str] = ()) -> tuple[bytes, str]:
    return generate_latest(registry(extra, workers)), CONTENT_TYPE_LATEST


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


class _Delegate(Collector):
    """Lets a fresh registry serve `source`'s metrics (the default registry's, or every
    process's files) without re-registering them; with shmserve_worker_ready at 0 for each of
    `workers` no live process wrote it. A stopped worker's live gauge file goes with it (the
    reaper), and its series then vanished: a panel's line ended, and an alert on
    `shmserve_worker_ready == 0` never fired (an outside check)."""

    def __init__(self, source, workers: tuple[str, ...] = (),
                 directory: Path | None = None) -> None:
        self._source = source
        self._workers = workers
        self._directory = directory  # multiprocess mode's: read under its lock (compact)

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
            yield ready


READY = "shmserve_worker_ready"  # gpu_workers.metrics'


def mark_dead(directory: Path, pids: Iterable[int] = ()) -> list[int]:
    """Forget the processes of `pids` and every other process of `directory` that no longer
    runs: their live-gauge files removed, their counter, histogram and max-gauge files merged
    into the archive files (`compact`). Returns the dead pids."""
    candidates = set(pids)
    for path in directory.glob("*.db"):
        match = _LIVE_GAUGE_FILE.match(path.name) or _KEPT_FILE.match(path.name)
        if match:
            candidates.add(int(match.groups()[-1]))
    dead = sorted(pid for pid in candidates if not processes.alive(pid))
    for pid in dead:
        multiprocess.mark_process_dead(pid, str(directory))
    compact(directory, dead)
    return dead


ARCHIVE = "{kind}_archive.db"  # the merged counts of exited processes, one file of each kind
_LOCK = ".scrape.lock"  # a scrape's shared lock, a merge's exclusive one


def compact(directory: Path, dead: Iterable[int]) -> int:
    """Merge the counter, histogram and max-gauge files of the `dead` processes into the
    archive files and remove them; returns how many files it merged. The sums stay as they were
    (a counter sample, a histogram bucket's, each key's values added; a max gauge's greatest
    value kept), and a scrape never sees a file
    both merged and still there, nor a file gone that it listed: the merge holds the
    directory's lock exclusively (`scrape_lock`), and the signals that stop this process wait
    until it is done. A merge killed part way (SIGKILL) is finished or undone by the next one
    (`_recover`); scrapes in between miss the files it had set aside."""
    merged, dead = 0, list(dead)
    kept = [directory / f"{kind}_{pid}.db" for kind in _KEPT_KINDS for pid in dead]
    if not any(path.exists() for path in kept) and not any(directory.glob("*_archive.new")) \
            and not any(directory.glob("*.merging")):
        return 0
    with scrape_lock(directory, exclusive=True), _signals_held():
        _recover(directory)
        for kind, merge in _KEPT_KINDS.items():
            files = [path for pid in dead
                     if (path := directory / f"{kind}_{pid}.db").exists()]
            if not files:
                continue
            archive = directory / ARCHIVE.format(kind=kind)
            totals: dict[str, float] = {}
            for path in ([archive] if archive.exists() else []) + files:
                for key, value, _, _ in mmap_dict.MmapedDict.read_all_values_from_file(
                        str(path)):
                    totals[key] = value if key not in totals else merge((totals[key], value))
            fresh = directory / f"{kind}_archive.new"  # not *.db: no scrape reads it
            out = ReservedMmapedDict(str(fresh))
            try:
                for key, value in totals.items():
                    out.write_value(key, value, 0.0)
            finally:
                out.close()
            # Set aside, then the archive that holds them replaced (the one step that
            # commits), then removed: killed anywhere, `_recover` tells which side it was on.
            aside = [path.with_suffix(".merging") for path in files]
            for path, moved in zip(files, aside):
                os.replace(path, moved)
            os.replace(fresh, archive)
            for moved in aside:
                moved.unlink()
            merged += len(files)
    return merged


def _recover(directory: Path) -> None:
    """After a merge killed part way: its new archive still there means the archive does not
    hold the files set aside (put back); gone, that it does (removed)."""
    for kind in _KEPT_KINDS:
        fresh = directory / f"{kind}_archive.new"
        aside = list(directory.glob(f"{kind}_*.merging"))
        if fresh.exists():
            for moved in aside:
                os.replace(moved, moved.with_suffix(".db"))
            fresh.unlink()
        else:
            for moved in aside:
                moved.unlink()


@contextlib.contextmanager
def scrape_lock(directory: Path, exclusive: bool = False):
    """The metrics directory's lock: shared by scrapes (they read every file), exclusive for a
    merge of files (`compact`). flock: released when its holder exits, however it exits."""
    fd = os.open(directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _signals_held():
    held = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
