"""Killing a hung process of this deployment, used both ways round: a frontend kills a worker
whose heartbeats stopped (frontend.watchdog), a worker kills a frontend whose pings stopped
(gpu_workers.worker).

Silence for `kill_after` seconds means the whole process is stuck (stopped, deadlocked, swapped
out for good): a worker answers pings from a thread that never waits on the model, a frontend
pings from its event loop every heartbeat interval. supervisord sees such a process RUNNING and
would never restart it. The watcher SIGKILLs the pid it last heard from, and supervisord
restarts it; only that process, only while it is still that program: its command line names
the module, this deployment's config.json and its index, and its start time is the one recorded
when it was first heard (a pid reused by another process is left alone). Several watchers may
kill the same process: a second SIGKILL finds it gone or dying, which is harmless.

A watcher that was itself stalled (its own checks late by more than `late_after`) has heard
nothing meanwhile through no fault of the watched: silence counts again from when it resumed.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import psutil


@dataclass(frozen=True, slots=True)
class Verdict:
    """What `HungKiller.check` did about a silent process."""

    silent_s: float
    killed: bool
    reason: str = ""  # why it was not killed


class HungKiller:
    def __init__(self, module: str, config_path: str, kill_after: float,
                 late_after: float, now: float) -> None:
        self.module = module  # what the watched run: python -m MODULE --config PATH --index I
        self.config_path = config_path
        self.kill_after = kill_after  # 0: never
        self.late_after = late_after
        self._starts: dict[int, tuple[int, float | None]] = {}  # index -> (pid, start time)
        self._tried: dict[int, int] = {}  # index -> the pid last judged hung
        self._last_tick = now
        self.awake_since = now

    def tick(self, now: float) -> None:
        """Once per round of checks, before them (time.monotonic())."""
        if now - self._last_tick > self.late_after:
            self.awake_since = now  # the watcher was stalled, not (only) the watched
        self._last_tick = now

    def heard(self, index: int, pid: int) -> None:
        """Every message from `index`: remember when a new process started."""
        if self._starts.get(index, (None,))[0] != pid:
            started = start_time(pid)
            if started is not None:  # else read again at its next message (out of descriptors)
                self._starts[index] = (pid, started)

    def check(self, index: int, pid: int, last_heard: float, now: float) -> Verdict | None:
        """SIGKILL `pid`, process `index`, if it has been silent since `last_heard` for
        `kill_after`; None when nothing was due (not silent so long, judged once already, or
        gone)."""
        if not self.kill_after:
            return None
        silent = now - max(last_heard, self.awake_since)
        if silent <= self.kill_after or self._tried.get(index) == pid:
            return None
        try:
            why = self.not_ours(index, pid)
        except OSError:  # this process's own want (out of descriptors, EMFILE): next round
            return None
        self._tried[index] = pid  # judged once per process
        if why == "gone":
            return None
        if why:
            return Verdict(silent, False, why)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None  # gone meanwhile: another watcher killed it, or it died
        except PermissionError as exc:
            return Verdict(silent, False, str(exc))
        return Verdict(silent, True)

    def not_ours(self, index: int, pid: int) -> str | None:
        """Why `pid` must not be killed as process `index` ("gone" when it has exited), or None
        when it is that process: the one heard from as it."""
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return "gone"
            argv, started = proc.cmdline(), proc.create_time()
        except psutil.NoSuchProcess:
            return "gone"
        except psutil.Error as exc:
            return f"cannot inspect it: {exc}"
        if not argv:  # exiting: its memory, the command line with it, is already released
            return "gone"
        if not is_program(argv, self.module, self.config_path, index):
            return f"pid {pid} is no longer {self.module} {index} of this deployment: {argv[:6]}"
        known_pid, known_start = self._starts.get(index, (None, None))
        if known_pid != pid or known_start is None or known_start != started:
            return f"pid {pid} started at another time than {self.module} {index}'s process"
        return None


def is_program(argv: list[str], module: str, config_path: str, index: int) -> bool:
    """Whether `argv` is process `index` of `module` (gpu_workers, frontend) in the deployment
    whose config is `config_path` (`python -m MODULE --config PATH --index I`, shmserve.render)."""
    def value(flag: str) -> str | None:
        return argv[argv.index(flag) + 1] if flag in argv[:-1] else None

    return module in argv and value("--config") == config_path and value("--index") == str(index)


def running_frontends(config_path: str, count: int) -> dict[int, int]:
    """The pids of the frontends of the deployment whose config is `config_path`, running now,
    by index."""
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        argv = proc.info["cmdline"] or []
        if "frontend" in argv:
            for index in range(count):
                if is_program(argv, "frontend", config_path, index):
                    found[index] = proc.info["pid"]
    return found


def start_time(pid: int) -> float | None:
    """None where it cannot be read: the process gone, or this one out of descriptors (psutil
    lets an EMFILE through as a plain OSError, which killed a frontend's heartbeat task)."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None
