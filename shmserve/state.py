"""Changes made through the admin API while the stack runs, kept in one file in the run directory
(``state.json``) so that every process agrees on them and a restarted one picks them up:

    {"sources": {UNIT: {"source": str, "revision": str}},   reloaded models (shmserve.models)
     "splits":  {MODEL: {VARIANT: weight}}}                   A/B weights

Owners: a frontend writes it, only after the change took effect (a reload committed on every
worker) or to make it take effect (a split), under an exclusive lock on ``state.lock``
(read-modify-write), and replaces it atomically (write, then rename), so a reader never sees half
a file. Workers read it when they start, before loading, and then every second, converging on
its sources (gpu_workers.slots, `reconcile`); frontends read it whenever it changed (`Watch`,
one stat per look). ``shmserve up`` removes it: at start the config is the truth.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import quote

from shmserve.config import Config
from shmserve.files import write_private
from shmserve.typedtree import ConfigError

log = logging.getLogger("shmserve.state")


@dataclass(frozen=True, slots=True)
class State:
    sources: dict[str, dict[str, str]] = field(default_factory=dict)
    splits: dict[str, dict[str, float]] = field(default_factory=dict)


def path(cfg: Config) -> Path:
    return cfg.run_dir / "state.json"


def read(cfg: Config) -> State:
    return _parse(path(cfg))


def update(cfg: Config, change: Callable[[dict], None]) -> State:
    """Apply `change` to the file's JSON tree under the lock; return the new state."""
    with _locked(cfg):
        file = path(cfg)
        try:
            tree = json.loads(file.read_text())
        except (FileNotFoundError, ValueError):
            tree = {}
        tree.setdefault("sources", {})
        tree.setdefault("splits", {})
        change(tree)
        write_private(file, json.dumps(tree, indent=2, sort_keys=True) + "\n")
    return _parse(file)


def remove(cfg: Config) -> None:
    path(cfg).unlink(missing_ok=True)


class Watch:
    """The current state, read again only when the file changed (its inode, size or mtime)."""

    def __init__(self, cfg: Config) -> None:
        self._path = path(cfg)
        self._stamp: tuple[int, int, int] | None = None
        self.state = State()

    def current(self) -> State:
        try:
            st = os.stat(self._path)
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            self._stamp = stamp
            self.state = _parse(self._path) if stamp is not None else State()
        return self.state


class Busy(Exception):
    """Another holds the lock (a reload of the same unit, an apply)."""


@contextmanager
def reloading(cfg: Config, unit: str) -> Iterator[None]:
    """Hold the deployment-wide right to reload `unit`, or raise Busy at once. Two admin calls
    reach different frontends through nginx; without it, each could take one worker's standby
    slot first and both fail with nothing reloaded."""
    # The name quoted: a model's name may hold a slash (org/model), and the lock's path then
    # named a directory that does not exist (a 500 from every reload of it: an outside check).
    with held(cfg.run_dir / f"reload-{quote(unit, safe='@')}.lock", unit):
        yield


def remove_reload_locks(cfg: Config) -> None:
    """The reload locks' files (`shmserve down`, once every process of the deployment is gone:
    only frontends hold one). Never while one may be held: a call that opened the file anew
    would lock another inode, and two reloads of one unit could run at once."""
    for lock in cfg.run_dir.glob("reload-*.lock"):
        lock.unlink(missing_ok=True)


@contextmanager
def held(lock: Path, what: str, holder: str = "", wait: bool = False) -> Iterator[None]:
    """An exclusive lock on the file `lock` for the block, or Busy(what) at once when another
    process (or another open of it) holds it (reloads of a unit, `shmserve apply`); `wait`:
    until it is free. With `holder`, written into the file while held, Busy carries the
    holder's instead."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise Busy(_holder(lock) or what if holder else what) from None
        if holder:
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder.encode(), 0)
        try:
            yield
        finally:
            if holder:  # no stale name for the next holder's contenders to read
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # closing releases the lock


def _holder(lock: Path) -> str:
    """The name the lock's holder wrote, waiting a moment for it: a holder writes it just
    after it took the lock (two `up`s at once: the refused one said "another command")."""
    for _ in range(20):
        if text := lock.read_text(errors="replace").strip():
            return text
        time.sleep(0.01)
    return ""


@contextmanager
def operating(cfg: Config, command: str) -> Iterator[None]:
    """One command that restarts programs (`restart`, `apply`) at a time on a deployment:
    two rolling restarts at once took both frontends down together (502s, both commands
    exiting 0), and a command whose program another restarted waited out its whole timeout
    (an outside check). Busy names the command that holds it (written in the lock file)."""
    if not cfg.run_dir.is_dir():  # no deployment there to restart programs of
        yield
        return
    with held(cfg.run_dir / "operation.lock", "another command",
              holder=f"`shmserve {command}` (pid {os.getpid()})"):
        yield


@contextmanager
def starting_or_stopping(cfg: Config, command: str, wait: bool) -> Iterator[None]:
    """`up` (until its supervisord has started) and `down` (to the end of its clean-up) one at a
    time on a run directory. Without it an `up` between a `down`'s supervisord exiting and the
    end of that `down` started a deployment whose programs the `down` then SIGKILLed (as orphans
    of this run directory) and whose pid file and control socket it removed: a supervisord
    that `status` and `down` no longer reached (an outside check). `down` waits for the lock
    (an `up` holds it a second or two); `up` raises Busy at once, naming the holder."""
    created = False
    if not cfg.run_dir.is_dir():
        if wait:  # nothing there yet for a `down` to stop or clean
            yield
            return
        if cfg.run_dir.exists() or cfg.run_dir.is_symlink():  # a file, or a dangling link
            raise ConfigError(f"server.run_dir: {cfg.run_dir} exists and is not a directory")
        # A first `up`: the directory is made for the lock, else two `up`s at once both went
        # ahead and one failed part way (a traceback from render, or supervisord's port taken).
        try:
            cfg.run_dir.mkdir(mode=0o700, parents=True)
            created = True
        except FileExistsError:
            pass
        except OSError as exc:  # under a file, a read-only or virtual file system, ...
            raise ConfigError(f"server.run_dir: cannot create {cfg.run_dir}: "
                              f"{exc.strerror or exc} ({exc.filename or cfg.run_dir})") from None
    lock = cfg.run_dir / "updown.lock"
    try:
        with held(lock, "another command", holder=f"`shmserve {command}` (pid {os.getpid()})",
                  wait=wait):
            yield
    finally:
        if created and [p.name for p in cfg.run_dir.iterdir()] == ["updown.lock"]:
            lock.unlink(missing_ok=True)  # a refused first `up` leaves no run directory
            try:
                cfg.run_dir.rmdir()
            except OSError:
                pass


@contextmanager
def _locked(cfg: Config) -> Iterator[None]:
    fd = os.open(cfg.run_dir / "state.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _parse(file: Path) -> State:
    """The file's valid entries; a damaged file or entry is logged and ignored, never fatal."""
    try:
        tree = json.loads(file.read_text())
    except FileNotFoundError:
        return State()
    except ValueError as exc:
        log.error("state.unreadable", extra={"fields": {"path": str(file), "error": str(exc)}})
        return State()
    sources = {unit: {"source": str(v.get("source", "")), "revision": str(v.get("revision", ""))}
               for unit, v in (tree.get("sources") or {}).items() if isinstance(v, dict)}
    splits = {}
    for model, weights in (tree.get("splits") or {}).items():
        if isinstance(weights, dict) and all(isinstance(w, (int, float)) and w >= 0
                                             for w in weights.values()):
            splits[model] = {k: float(w) for k, w in weights.items()}
    return State(sources, splits)


# ---- the deployment's start, and each worker's failed loads ---------------------------------
# Two more facts of a deployment kept as files in the run directory, which `up` and `down`
# remove (`remove_marks`): whether every worker has been ready once since `up` (`started`), and
# how many loads in a row a worker has failed (`count_load_failure`).

def _started(cfg: Config) -> Path:
    return cfg.run_dir / "started"


def mark_started(cfg: Config) -> None:
    """Every configured worker has been ready once since `up` (a frontend saw it): a frontend
    restarted later joins a running deployment, whose /ready says "degraded" rather than
    "loading" while a worker is down (frontend.pool.WorkerPool.started)."""
    _started(cfg).touch(exist_ok=True)


def has_started(cfg: Config) -> bool:
    return _started(cfg).exists()


def _load_failures(cfg: Config, worker: int) -> Path:
    return cfg.run_dir / f"worker-{worker}.load-failures"


def count_load_failure(cfg: Config, worker: int) -> int:
    """One more failed load of `worker`'s models in a row: how many now (gpu_workers.worker
    waits longer after each before its process exits and supervisord starts it again)."""
    file = _load_failures(cfg, worker)
    try:
        count = int(file.read_text()) + 1
    except (OSError, ValueError):
        count = 1
    file.write_text(str(count))
    return count


def load_failures(cfg: Config, worker: int) -> int:
    """How many of `worker`'s loads failed in a row (count_load_failure), 0 where none did."""
    try:
        return int(_load_failures(cfg, worker).read_text())
    except (OSError, ValueError):
        return 0


def clear_load_failures(cfg: Config, worker: int) -> None:
    """`worker` loaded its models."""
    _load_failures(cfg, worker).unlink(missing_ok=True)


def remove_marks(cfg: Config) -> None:
    """`up` and `down`: a new deployment has not started, and no worker of it has failed."""
    _started(cfg).unlink(missing_ok=True)
    for file in cfg.run_dir.glob("worker-*.load-failures"):
        file.unlink(missing_ok=True)
