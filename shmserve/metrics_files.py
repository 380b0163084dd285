"""The multiprocess directory's files (PROMETHEUS_MULTIPROC_DIR; see shmserve.metrics): each
process's files reserved as they grow, the merge of exited processes' files into one archive of
each kind (run by shmserve.reaper), and the lock that keeps a scrape from reading a merge half
done."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
from pathlib import Path
from typing import Iterable

from prometheus_client import mmap_dict, multiprocess

from shmserve import processes

_LIVE_GAUGE_FILE = re.compile(r"^gauge_live[a-z]*_(\d+)\.db$")
# a process's counts, and its highest values (merged: summed, or the greatest kept)
_KEPT_FILE = re.compile(r"^(counter|histogram|gauge_max)_(\d+)\.db$")
_KEPT_KINDS = {"counter": sum, "histogram": sum, "gauge_max": max}  # kind -> how it merges

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
    value kept; a counter at 0 left out), and a scrape never sees a file
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
            if kind == "counter":
                # A series only dead processes held and none ever counted: a program or model
                # since removed (an apply from 3 frontends to 2 kept frontend-2's exits at 0
                # in /metrics for good, an outside check). A live process that has it keeps it.
                totals = {key: value for key, value in totals.items() if value}
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
