"""Shared-memory arenas: the only module that turns `ShmHandle`s into numpy views.

An arena is a file under /dev/shm mapped with `mmap`; we do not use
`multiprocessing.shared_memory`, whose resource tracker (Python 3.11) may unlink a segment when
any attaching process exits.

Ownership, stated once:
  * Each frontend process creates exactly one arena, named
    ``shmserve-<instance>-fe<index>-<pid>-<random>``, and is its only allocator. It creates
    the file itself (O_EXCL, O_NOFOLLOW) under a name no one can foresee, and workers map only
    a regular file of their own user (O_NOFOLLOW): another local user could otherwise have
    created the predictable name first and read or written the requests in it, or had a
    frontend running as root truncate any file through a symlink (a security review). It
    allocates one slot per request (token ids, offsets and the output rows), writes the inputs,
    and frees the slot when the worker's terminal reply (Result or Error) arrives, or when that
    worker is declared dead. A slot is never freed while a live worker may still write to it,
    so an aborted or timed-out request keeps its slot until the worker answers.
  * Between Submit and its terminal reply, the slot's output rows are lent to the one worker the
    request went to; nobody else writes them.
  * The creator unlinks its arena on clean exit. A killed frontend's arena is swept by the next
    process of the same index (`sweep` with its prefix) and by ``shmserve up``/``down`` (the
    instance prefix), so /dev/shm does not grow across restarts.
  * The creator holds a shared `flock` on its arena while it lives, so an arena whose creator is
    gone can be told from one in use by any process, even one in another pid namespace:
    `sweep_orphans` (``shmserve up``/``down``) removes those of every deployment, including
    one whose whole process tree was killed and whose run directory is gone.
  * Workers only attach (`Attachments`), and drop a mapping once its file is gone.

tmpfs allocates pages only when touched, so a large arena costs nothing until it is used.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import math
import mmap
import os
import re
import secrets
import time
from pathlib import Path
from stat import S_ISREG

import numpy as np

from shmserve.protocol import ShmHandle

SHM_DIR = Path("/dev/shm")
ALIGN = 64


# Pages are reserved in /dev/shm ahead of use in steps this large (fewer system calls).
RESERVE_STEP = 1 << 20


class ArenaFull(MemoryError):
    """No free range is large enough; the caller answers 429 (too much in flight)."""


class ShmFull(MemoryError):
    """/dev/shm has no room for pages of the arena not used before (others filled it); the
    caller answers 503. The arena itself is sparse until used: a write to a page that tmpfs
    cannot allocate kills the writer with SIGBUS, frontend or worker (an outside check: every
    frontend and worker crash-looped while /ready said ready), so pages are reserved
    (fallocate) before an allocation can hand them out."""


def arena_name(instance: str, role: str, pid: int | None = None) -> str:
    return (f"shmserve-{instance}-{role}-{os.getpid() if pid is None else pid}-"
            f"{secrets.token_hex(8)}")


_ARENA_FILE = re.compile(r"^shmserve-[0-9a-f]+-[a-z0-9]+-(?P<pid>\d+)(-[0-9a-f]+)?$")
ORPHAN_MIN_AGE_S = 10.0  # younger segments may be between their creation and their lock


def sweep_orphans(directory: Path = SHM_DIR, min_age_s: float | None = None) -> list[str]:
    """Remove every shmserve arena, of any deployment, that no live creator holds.

    An arena's creator holds a shared lock on it (`Arena`); if an exclusive lock can be taken,
    nobody does: its process was killed (SIGKILL, OOM killer, a killed process group) before it
    could unlink the file. Segments changed in the last `min_age_s` are left, since a creator
    locks its file just after creating it."""
    min_age_s = ORPHAN_MIN_AGE_S if min_age_s is None else min_age_s
    removed = []
    now = time.time()
    for path in directory.glob("shmserve-*"):
        if not _ARENA_FILE.match(path.name):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, PermissionError):  # gone, or another user's (unreadable)
            continue
        try:
            stat = os.fstat(fd)
            if stat.st_uid != os.geteuid():
                continue  # another user's deployment: /dev/shm's sticky bit keeps it theirs
            if now - stat.st_ctime < min_age_s:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its creator lives
            path.unlink(missing_ok=True)
            removed.append(path.name)
        finally:
            os.close(fd)
    return removed


def sweep(prefix: str, directory: Path = SHM_DIR) -> list[str]:
    """Remove every segment whose name starts with `prefix` (left behind by a killed process)."""
    removed = []
    for path in directory.glob(prefix + "*"):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            pass
    return removed


class Arena:
    """A shared-memory region with a first-fit allocator; one owner allocates and frees."""

    def __init__(self, name: str, size: int, directory: Path = SHM_DIR) -> None:
        self.name = name
        self.size = size
        self.path = directory / name
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # held while this process lives: `sweep_orphans`
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd
        self._buf = np.frombuffer(self._mm, dtype=np.uint8)
        self._free_starts = [0]  # sorted start offsets of free ranges
        self._free_sizes = {0: size}
        self._used: dict[int, int] = {}
        self._reserved = 0  # bytes from the start whose pages are allocated in /dev/shm

    @property
    def bytes_used(self) -> int:
        return sum(self._used.values())

    def unlinked(self) -> bool:
        """Whether this arena's file was removed from its directory while open (by hand, a
        /dev/shm cleaner, systemd-logind's RemoveIPC): no worker can map it any more."""
        try:
            return self._lock_fd >= 0 and os.fstat(self._lock_fd).st_nlink == 0
        except OSError:
            return False

    def alloc(self, nbytes: int) -> int:
        need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for start in self._free_starts:
            have = self._free_sizes[start]
            if have >= need:
                self._reserve(start + need)
                self._take(start, have, need)
                return start
        raise ArenaFull(f"arena {self.name}: no {need} free bytes ({self.bytes_used} of "
                        f"{self.size} in use); raise shm.arena_mb")

    def _reserve(self, end: int) -> None:
        """Allocate the arena's pages up to `end` (in RESERVE_STEP steps) before anyone writes
        them; once reserved they stay (the first-fit allocator reuses the low ranges)."""
        if end <= self._reserved:
            return
        upto = min(self.size, -(-end // RESERVE_STEP) * RESERVE_STEP)
        try:
            os.posix_fallocate(self._lock_fd, self._reserved, upto - self._reserved)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
                raise
            raise ShmFull(f"{self.path.parent} is full: no room for {upto - self._reserved:,} "
                          f"more bytes of this frontend's shared memory ({self._reserved:,} of "
                          f"{self.size:,} reserved so far); others filled it, or it is smaller "
                          "than frontends.count x shm.arena_mb") from None
        self._reserved = upto

    def _take(self, start: int, have: int, need: int) -> None:
        i = bisect.bisect_left(self._free_starts, start)
        del self._free_starts[i]
        del self._free_sizes[start]
        if have > need:
            rest = start + need
            self._free_starts.insert(i, rest)
            self._free_sizes[rest] = have - need
        self._used[start] = need

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)  # KeyError: a double free is a bug, let it surface
        i = bisect.bisect_left(self._free_starts, offset)
        # Coalesce with the following free range, then with the preceding one.
        if i < len(self._free_starts) and self._free_starts[i] == offset + size:
            size += self._free_sizes.pop(self._free_starts.pop(i))
        if i > 0:
            prev = self._free_starts[i - 1]
            if prev + self._free_sizes[prev] == offset:
                self._free_sizes[prev] += size
                return
        self._free_starts.insert(i, offset)
        self._free_sizes[offset] = size

    def handle(self, offset: int, dtype: str, shape: tuple[int, ...]) -> ShmHandle:
        nbytes = np.dtype(dtype).itemsize * math.prod(shape)
        return ShmHandle(self.name, offset, nbytes, dtype, tuple(int(s) for s in shape))

    def view(self, handle: ShmHandle) -> np.ndarray:
        return _view(self._buf, handle)

    def close(self, unlink: bool = True) -> None:
        self._buf = None  # release the exported buffer before closing the map
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the process
        if unlink:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


class Attachments:
    """A worker's read/write mappings of frontend arenas, keyed by arena name."""

    def __init__(self, directory: Path = SHM_DIR) -> None:
        self._dir = directory
        self._maps: dict[str, tuple[mmap.mmap, np.ndarray]] = {}

    def view(self, handle: ShmHandle) -> np.ndarray:
        entry = self._maps.get(handle.arena)
        if entry is None:
            entry = self._attach(handle.arena)
        return _view(entry[1], handle)

    def _attach(self, name: str) -> tuple[mmap.mmap, np.ndarray]:
        if "/" in name or not name.startswith("shmserve-"):
            raise ValueError(f"not a shmserve arena: {name!r}")
        self.drop_vanished()
        fd = os.open(self._dir / name, os.O_RDWR | os.O_NOFOLLOW)
        try:
            stat = os.fstat(fd)
            if not S_ISREG(stat.st_mode) or stat.st_uid != os.geteuid():
                raise ValueError(f"arena {name!r} is not a regular file of this user")
            mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        entry = (mm, np.frombuffer(mm, dtype=np.uint8))
        self._maps[name] = entry
        return entry

    def drop_vanished(self) -> None:
        """Forget mappings whose file was unlinked (a restarted frontend has a new arena): a
        dead frontend's pages stay allocated in /dev/shm while mapped here. A mapping whose
        creator (the pid in its name; frontends and workers share supervisord's pid namespace)
        still runs is kept: its file was deleted under a live frontend (a /dev/shm cleaner,
        RemoveIPC), which logs frontend.file_lost and drains, and the requests it drains can
        only be served through the mappings held here (dropped, each was answered 503 until
        the frontend had stopped: a soak check)."""
        for name in [n for n in self._maps if not (self._dir / n).exists()]:
            if _creator_runs(name):
                continue  # dropped at a later look, once its frontend is gone
            del self._maps[name]  # the mmap is closed when the last view goes

    def close(self) -> None:
        self._maps.clear()


def _creator_runs(name: str) -> bool:
    """Whether the process that made arena `name` (arena_name: its pid) still runs, as /proc
    shows it (a zombie is gone)."""
    found = _ARENA_FILE.match(name)
    if found is None:
        return False
    try:
        stat = Path(f"/proc/{found['pid']}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] not in (["Z"], ["X"], [])


def _view(buf: np.ndarray, handle: ShmHandle) -> np.ndarray:
    end = handle.offset + handle.nbytes
    if handle.offset < 0 or end > buf.size:
        raise ValueError(f"handle outside arena {handle.arena}: {handle.offset}+{handle.nbytes}")
    dtype = np.dtype(handle.dtype)
    if dtype.itemsize * math.prod(handle.shape) != handle.nbytes:
        raise ValueError(f"handle shape {handle.shape} {handle.dtype} != {handle.nbytes} bytes")
    return buf[handle.offset:end].view(dtype).reshape(handle.shape)
