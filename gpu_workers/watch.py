"""A worker's watch on the frontends: one whose pings it has not heard for
`frontends.hung_kill_s` (every frontend pings every worker each `workers.heartbeat_interval_s`,
from its event loop) is stuck as a whole (stopped, its loop blocked for good), and supervisord,
which sees it RUNNING, would never restart it; meanwhile nginx keeps the requests it gave it
waiting and gives it new ones. The worker SIGKILLs it (shmserve.hung: only while that pid is
still that frontend), supervisord restarts it, and nginx sends the requests it held, whose
connections drop, to another frontend. Every worker watches: several may kill one frontend,
which is harmless. A worker that starts finds the configured frontends' processes (their
command lines) and counts their silence from its own start, so a frontend frozen before it
started (a worker restarted meanwhile never hears its pings) is killed too; but not one started
before the run directory's config.json was last written: it runs an older config (`shmserve
apply` writes the new one, then starts the workers it adds, and restarts the frontends last), in
which this worker may not be, so it never pings it. Judged from its start, every such frontend
was SIGKILLed at once by each added worker that waited `frontends.hung_kill_s` for the frontend
restarts (a kept worker restarting first, a slow load): 502s in an outside check. Such a
frontend is judged from its first ping, and meanwhile by the workers it does ping. Runs on the
socket thread.
"""

from __future__ import annotations

import logging
import os
import time

import psutil

from shmserve import topology
from shmserve.config import Config
from shmserve.hung import HungKiller, running_frontends, start_time
from shmserve.protocol import Ping

log = logging.getLogger("shmserve.worker")

# A process's start time (psutil: the boot time in whole seconds plus its start in jiffies) reads
# up to a second early against file times: a frontend is taken as started before config.json
# was written only when it started this much before.
CLOCK_SLACK_S = 1.5


class FrontendWatch:
    def __init__(self, cfg: Config, worker: int, metrics) -> None:
        now = time.monotonic()
        self.worker = worker
        self.metrics = metrics  # gpu_workers.metrics.WorkerMetrics
        self.interval = cfg.workers.heartbeat_interval_s
        self.hung = HungKiller("frontend", str(topology.resolved_config_path(cfg)),
                               cfg.frontends.hung_kill_s, cfg.workers.heartbeat_timeout_s, now)
        self._heard: dict[int, tuple[int, float]] = {}  # frontend -> (pid, monotonic last ping)
        self._checked = now
        # Frontends found at start and not heard since: frontend -> its CPU seconds when last
        # judged (its pid is the one in _heard until a ping takes it off this map). One whose
        # CPU time moves while it stays silent to this worker runs (pinging the workers it
        # reaches) but cannot reach this one: out of descriptors, it has none for the
        # connection (an outside check: a worker restarted under load SIGKILLed a frontend at
        # its open-files limit 30 s later). A frozen or deadlocked one uses no CPU. (One whose
        # loop spins, CPU moving, is left to the workers that heard it before and hear it no
        # more: with a single worker, restarted, it is spared.)
        self._unheard: dict[int, float | None] = {}
        for frontend in range(cfg.frontends.count):
            metrics.watching(frontend)
        if self.hung.kill_after:
            written = _written(self.hung.config_path)
            for frontend, pid in running_frontends(self.hung.config_path,
                                                   cfg.frontends.count).items():
                started = start_time(pid)
                if written is not None and started is not None \
                        and started < written - CLOCK_SLACK_S:
                    continue  # on an older config: judged from its first ping
                self._heard[frontend] = (pid, now)  # silent from now, until its first ping
                self._unheard[frontend] = cpu_seconds(pid)
                self.hung.heard(frontend, pid)

    def pinged(self, ping: Ping) -> None:
        if ping.frontend >= 0:
            if ping.frontend not in self._heard:  # one `shmserve apply` added
                self.metrics.watching(ping.frontend)
            self._heard[ping.frontend] = (ping.pid, time.monotonic())
            self._unheard.pop(ping.frontend, None)
            self.hung.heard(ping.frontend, ping.pid)

    def tick(self) -> None:
        """Every round of the socket thread's loop; checks once a heartbeat interval."""
        now = time.monotonic()
        if now - self._checked < self.interval:
            return
        self._checked = now
        self.hung.tick(now)
        for frontend, (pid, last) in list(self._heard.items()):
            if frontend in self._unheard and \
                    now - max(last, self.hung.awake_since) > self.hung.kill_after > 0:
                seen_cpu, cpu = self._unheard[frontend], cpu_seconds(pid)
                if cpu is not None and seen_cpu is not None and cpu > seen_cpu:
                    # it runs, but has not reached this worker
                    log.warning("worker.frontend_unreached", extra={"fields": {
                        "frontend": frontend, "frontend_pid": pid,
                        "silent_s": round(now - last, 1), "cpu_s": round(cpu - seen_cpu, 2)}})
                    self._heard[frontend] = (pid, now)  # judged again a hung_kill_s on
                    self._unheard[frontend] = cpu
                    continue
            verdict = self.hung.check(frontend, pid, last, now)
            if verdict is None:
                continue
            fields = {"frontend": frontend, "frontend_pid": pid,
                      "silent_s": round(verdict.silent_s, 1)}
            if verdict.killed:
                self.metrics.frontend_killed(frontend)
                log.error("worker.frontend_hung_killed", extra={"fields": {
                    **fields, "hung_kill_s": self.hung.kill_after}})
            else:
                log.warning("worker.frontend_hung_not_killed",
                            extra={"fields": {**fields, "reason": verdict.reason}})


def cpu_seconds(pid: int) -> float | None:
    """The CPU time `pid` has used (user and system), or None where it cannot be read."""
    try:
        times = psutil.Process(pid).cpu_times()
    except (psutil.Error, OSError):
        return None
    return times.user + times.system


def _written(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None
