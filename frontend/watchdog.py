"""A frontend's watchdog over the workers: kill a hung one, report a stalled one.

Hung: a worker silent for `workers.hung_kill_s` (longer than `heartbeat_timeout_s`, after which
it is already out of routing). Its heartbeats come from its socket thread, which never waits on
the model, so such silence means its whole process is stuck (stopped, deadlocked, swapped out
for good) and supervisord, which sees it RUNNING, would never restart it. The frontend SIGKILLs
the pid it last heartbeated with, and supervisord restarts it. Only that process, only while it
is still that worker: its command line names gpu_workers, this deployment's config.json and
its index, and its start time is the one recorded when it first heartbeated (a pid reused by
another process is left alone). Every frontend watches, so several may kill the same process:
a second SIGKILL finds it gone or dying, which is harmless.

A frontend that was itself stalled (its event loop late by more than `heartbeat_timeout_s`)
has heard nothing meanwhile through no fault of the workers: silence counts again from when
it resumed.

Stalled: a worker whose heartbeats say its forward pass has run for `workers.stalled_pass_s`
(the model thread stuck, say on a CUDA hang, while the socket thread answers). Reported in
GET /ready and logged, not killed: a long pass (a huge batch on a CPU, first-time kernel
plans, out-of-memory halving) cannot be told from a hang by time alone, and a kill loses the
worker's queue, its staged reloads and, on a GPU, may find the device no better on restart.
Its requests are bounded anyway by their deadlines (`frontends.request_timeout_s`).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import TYPE_CHECKING

import psutil

from frontend import metrics
from shmserve import topology
from shmserve.config import Config
from shmserve.protocol import Heartbeat

if TYPE_CHECKING:
    from frontend.pool import WorkerLink

log = logging.getLogger("shmserve.frontend")


class Watchdog:
    def __init__(self, cfg: Config, frontend: int) -> None:
        self.kill_after = cfg.workers.hung_kill_s
        self.stall_after = cfg.workers.stalled_pass_s
        self.late_after = cfg.workers.heartbeat_timeout_s
        self.frontend = frontend
        self.config_path = str(topology.resolved_config_path(cfg))
        self._starts: dict[int, tuple[int, float | None]] = {}  # worker -> (pid, start time)
        self._tried: dict[int, int] = {}  # worker -> the pid last judged hung
        self._stalled: set[int] = set()  # workers whose running pass is past stall_after
        self._last_tick = time.monotonic()
        self._awake_since = self._last_tick

    def tick(self, now: float) -> None:
        """Once per heartbeat round, before `check`."""
        if now - self._last_tick > self.late_after:
            self._awake_since = now  # this frontend was stalled, not (only) the workers
        self._last_tick = now

    def heard(self, index: int, beat: Heartbeat) -> None:
        """Every heartbeat: remember when a new worker process started; log stalls."""
        if self._starts.get(index, (None,))[0] != beat.pid:
            self._starts[index] = (beat.pid, _start_time(beat.pid))
        stalled = self.stalled(beat)
        if stalled and index not in self._stalled:
            self._stalled.add(index)
            log.warning("frontend.worker_stalled", extra={"fields": {
                "worker": index, "worker_pid": beat.pid, "pass_s": round(beat.pass_s, 1)}})
        elif not stalled and index in self._stalled:
            self._stalled.discard(index)
            log.info("frontend.worker_unstalled", extra={"fields": {
                "worker": index, "worker_pid": beat.pid}})

    def stalled(self, beat: Heartbeat) -> bool:
        return bool(self.stall_after) and beat.pass_s > self.stall_after

    def check(self, link: WorkerLink, now: float) -> None:
        """Kill `link`'s worker if it has been silent for `workers.hung_kill_s`."""
        if not self.kill_after or link.beat is None:
            return
        pid = link.beat.pid
        silent = now - max(link.last_beat, self._awake_since)
        if silent <= self.kill_after or self._tried.get(link.index) == pid:
            return
        self._tried[link.index] = pid  # judged once per process
        why = self.not_ours(link.index, pid)
        if why == "gone":
            return
        if why:
            log.warning("frontend.worker_hung_not_killed", extra={"fields": {
                "worker": link.index, "worker_pid": pid, "silent_s": round(silent, 1),
                "reason": why}})
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return  # gone meanwhile: another frontend killed it, or it died
        except PermissionError as exc:
            log.warning("frontend.worker_hung_not_killed", extra={"fields": {
                "worker": link.index, "worker_pid": pid, "reason": str(exc)}})
            return
        metrics.WORKER_HUNG_KILLS.labels(str(self.frontend), str(link.index)).inc()
        log.error("frontend.worker_hung_killed", extra={"fields": {
            "worker": link.index, "worker_pid": pid, "silent_s": round(silent, 1),
            "hung_kill_s": self.kill_after}})

    def not_ours(self, index: int, pid: int) -> str | None:
        """Why `pid` must not be killed as worker `index` ("gone" when it has exited), or
        None when it is that worker: the process that heartbeated as it."""
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return "gone"
            argv, started = proc.cmdline(), proc.create_time()
        except psutil.NoSuchProcess:
            return "gone"
        except psutil.Error as exc:
            return f"cannot inspect it: {exc}"
        if not is_worker(argv, self.config_path, index):
            return f"pid {pid} is no longer worker {index} of this deployment: {argv[:6]}"
        known_pid, known_start = self._starts.get(index, (None, None))
        if known_pid != pid or known_start is None or known_start != started:
            return f"pid {pid} started at another time than worker {index}'s process"
        return None


def is_worker(argv: list[str], config_path: str, index: int) -> bool:
    """Whether `argv` is worker `index` of the deployment whose config is `config_path`
    (`python -m gpu_workers --config PATH --index I`, shmserve.render)."""
    def value(flag: str) -> str | None:
        return argv[argv.index(flag) + 1] if flag in argv[:-1] else None

    return "gpu_workers" in argv and value("--config") == config_path and \
        value("--index") == str(index)


def _start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None
