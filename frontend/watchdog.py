"""A frontend's watchdog over the workers: kill a hung one, report a stalled one.

Hung: a worker silent for `workers.hung_kill_s` (longer than `heartbeat_timeout_s`, after which
it is already out of routing). Its heartbeats come from its socket thread, which never waits on
the model, so such silence means its whole process is stuck; the frontend SIGKILLs it, only
while it is still that worker, and supervisord restarts it (shmserve.hung, which the workers
use the other way round on a frontend whose pings stopped).

Stalled: a worker whose heartbeats say its forward pass has run for `workers.stalled_pass_s`
(the model thread stuck, say on a CUDA hang, while the socket thread answers). Reported in
GET /ready and logged, not killed: a long pass (a huge batch on a CPU, first-time kernel
plans, out-of-memory halving) cannot be told from a hang by time alone, and a kill loses the
worker's queue, its staged reloads and, on a GPU, may find the device no better on restart.
Its requests are bounded anyway by their deadlines (`frontends.request_timeout_s`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from frontend import metrics
from shmserve import topology
from shmserve.config import Config
from shmserve.hung import HungKiller
from shmserve.protocol import Heartbeat

if TYPE_CHECKING:
    from frontend.links import WorkerLink

log = logging.getLogger("shmserve.frontend")


class Watchdog:
    def __init__(self, cfg: Config, frontend: int) -> None:
        self.stall_after = cfg.workers.stalled_pass_s
        self.frontend = frontend
        self.hung = HungKiller("gpu_workers", str(topology.resolved_config_path(cfg)),
                               cfg.workers.hung_kill_s, cfg.workers.heartbeat_timeout_s,
                               time.monotonic())
        self._stalled: set[int] = set()  # workers whose running pass is past stall_after

    def tick(self, now: float) -> None:
        """Once per heartbeat round, before `check`."""
        self.hung.tick(now)

    def heard(self, index: int, beat: Heartbeat) -> None:
        """Every heartbeat: remember when a new worker process started; log stalls."""
        self.hung.heard(index, beat.pid)
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
        if link.beat is None:
            return
        pid = link.beat.pid
        verdict = self.hung.check(link.index, pid, link.last_beat, now)
        if verdict is None:
            return
        fields = {"worker": link.index, "worker_pid": pid,
                  "silent_s": round(verdict.silent_s, 1)}
        if not verdict.killed:
            log.warning("frontend.worker_hung_not_killed",
                        extra={"fields": {**fields, "reason": verdict.reason}})
            return
        metrics.WORKER_HUNG_KILLS.labels(str(self.frontend), str(link.index)).inc()
        log.error("frontend.worker_hung_killed",
                  extra={"fields": {**fields, "hung_kill_s": self.hung.kill_after}})
