"""What the worker's socket thread (gpu_workers.sockets) does with what arrives: Submits
admitted or refused (the queue bound and the deadline estimate, shmserve.admission), aborts
marked, reloads and commits handed to the model thread, heartbeats answered and news sent.

The model thread (gpu_workers.worker) takes admitted requests, reloads and commits from
`inbox`, writes what heartbeats report into `Status`, and says through `finished` and
`backlog` what it has answered and computed. Both threads write `queued_texts`, under the
lock here, and the backlog, under its own.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gpu_workers.batcher import Arrivals
from gpu_workers.metrics import WorkerMetrics
from gpu_workers.requests import Request, read_request
from gpu_workers.slots import Orphaned
from gpu_workers.watch import FrontendWatch
from shmserve.admission import Backlog
from shmserve.arena import Attachments
from shmserve.config import Config
from shmserve.models import ModelSpec
from shmserve.protocol import (PROTOCOL_VERSION, Abort, Commit, Error, ErrorCode, Heartbeat,
                               ModelInfo, Ping, Reload, Submit, Unloaded)

log = logging.getLogger("shmserve.worker")

# How often the socket thread looks whether the frontends it has heard from still run: a
# killed frontend's queued requests are dropped within this, before nginx's retries of them
# (sent at once to another frontend) are refused for that queue or wait behind it.
LOOK_S = 0.02
DROP_S = 1.0  # how often unlinked arenas are unmapped

# A request that takes this long here (its tokens at the worker's drain rate) is news to the
# frontends that did not send it (Intake.news): a short request waits that long behind it.
NEWS_S = 0.05

# A worker that has mapped no request's shared memory of a frontend for this long, every try
# failing (no file descriptor left: a leak, or a limit too low), exits for supervisord to start
# it afresh: it answered that frontend's every request 503 for good (an arena mapped before the
# descriptors ran out still served the other's) while its heartbeats, and /ready, said it
# served.
UNMAPPABLE_EXIT_S = 10.0
EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)  # what a fresh process may not meet


class Unwell(RuntimeError):
    """The worker cannot serve for a reason a fresh process may not have (Intake.unwell): it
    answers what it holds UNAVAILABLE, for the frontends to send elsewhere, and exits."""


@dataclass
class Status:
    """What heartbeats say of the model thread: written by it, read by the socket thread
    (each field one read or write, so no lock)."""
    infos: tuple[ModelInfo, ...]
    ready: bool = False
    device_label: str = "loading"
    pass_began: float = 0.0  # monotonic start of the forward pass running now; 0: none
    failure: str = ""  # the load failed: its error (Heartbeat.failure)
    unloaded: tuple[Unloaded, ...] = ()  # its models that did not load while others did


class Intake:
    def __init__(self, cfg: Config, index: int, specs: dict[str, ModelSpec],
                 metrics: WorkerMetrics, stopping: threading.Event, status: Status) -> None:
        self.cfg = cfg
        self.index = index
        self.specs = specs  # the worker's, which a model loaded later joins
        self.metrics = metrics
        self.stopping = stopping
        self.status = status
        # Requests, (peer, Reload | Commit), Built, Orphaned
        self.inbox: queue.Queue = queue.Queue()
        self.backlog = Backlog()  # admitted tokens and their speed: admission by deadline
        self.arrivals = Arrivals(cfg.batching.max_wait_ms / 1000)  # read by the model thread
        self.attachments = Attachments()
        self.watch = FrontendWatch(cfg, index, metrics)
        self.queued_texts = 0  # admitted, not yet answered; guarded by _lock
        self.orphaned_texts = 0  # of those, a gone frontend's (to be dropped); under _lock
        self._lock = threading.Lock()
        self._requests: dict[tuple[bytes, int], Request] = {}
        self._admitted = 0  # tokens of the request on_submit just admitted
        self.small_at = 0.0  # Heartbeat.small_at
        # frontend index -> (its socket, its pid if this worker can see that process, else 0)
        self._frontends: dict[int, tuple[bytes, int]] = {}
        self._looked = 0.0  # monotonic time of the last look for frontends gone
        self._dropped = 0.0  # ... and for arenas unlinked (Attachments.drop_vanished)
        self._unreadable_logged = 0.0  # worker.arena_unreadable's last line
        # by frontend (its socket): monotonic time of the first failed map since one worked
        self._unmappable_since: dict[bytes, float] = {}
        self.unwell = ""  # why this worker should exit (UNMAPPABLE_EXIT_S); read by the model
        # thread, which does; heartbeats say not ready from when it is set

    def heartbeat(self, ping: Ping, peer: bytes = b"") -> Heartbeat:
        if ping.frontend >= 0 and peer:
            old = self._frontends.get(ping.frontend)
            if old is None or old[0] != peer:
                self._frontends[ping.frontend] = (peer, ping.pid if running(ping.pid) else 0)
                if old is not None:  # another process serves it now (if tick did not see)
                    self.orphan(old[0], ping.frontend)
        self.watch.pinged(ping)
        self.metrics.set_queue_depth(self.queued_texts)  # fresh even while no batch runs
        return self._beat(ping.sent_at)

    def _beat(self, ping_sent_at: float) -> Heartbeat:
        status = self.status
        began = status.pass_began  # one read: the model thread may clear it meanwhile
        return Heartbeat(PROTOCOL_VERSION, self.index, os.getpid(),
                         status.ready and not self.stopping.is_set() and not self.unwell,
                         status.device_label,
                         status.infos, self.queued_texts, self.cfg.workers.queue_texts,
                         ping_sent_at, time.monotonic() - began if began else 0.0,
                         self.backlog.rate, self.backlog.pass_s,
                         self.backlog.queued_by_priority(), status.failure, status.unloaded,
                         self.small_at)

    def tick(self) -> None:
        """Every round of the socket thread's loop (at most POLL_MS apart): the watch on hung
        frontends, and every LOOK_S a look for frontends whose process is gone."""
        self.watch.tick()
        self._look()

    def _look(self) -> None:
        now = time.monotonic()
        if now - self._looked < LOOK_S:
            return
        self._looked = now
        if now - self._dropped > DROP_S:
            # A killed frontend's arena, unlinked: unmapped here too, or its pages stay held
            # in /dev/shm (a replacement frontend met a full /dev/shm: a second outside check).
            self._dropped = now
            self.attachments.drop_vanished()
        for frontend, (peer, pid) in list(self._frontends.items()):
            if pid and not running(pid):  # killed or crashed, not yet replaced
                del self._frontends[frontend]
                self.orphan(peer, frontend)

    def orphan(self, peer: bytes, frontend: int) -> None:
        """What `peer` sent can be answered to no one now (its socket, shared memory and
        clients are gone): dropped before it runs, as an abort is, and off the queue bound and
        the backlog (shmserve.admission) at once, so the clients' retries through nginx are
        not refused for it. The model thread keeps taking a request's computed tokens off the
        backlog as it goes (tokens_left); this takes what was left then (`released_tokens`),
        and finished() squares the two. A killed
        frontend's queued work kept a worker busy for seconds (an outside check: 256 texts,
        ~10 s), and the retries were refused 429 meanwhile."""
        self.inbox.put(Orphaned(peer))  # its reloads, too (gpu_workers.slots)
        self._unmappable_since.pop(peer, None)  # its arena's failures with it
        dropped = 0
        with self._lock:  # as finished(): a request is released once
            for (sender, _), request in list(self._requests.items()):
                if sender == peer and not request.orphaned:
                    request.aborted = request.orphaned = True
                    self.orphaned_texts += request.offsets.shape[0] - 1
                    request.released_tokens = request.tokens_left  # (read: the model thread's)
                    self.backlog.done(request.msg.priority, request.released_tokens)
                    dropped += 1
        if dropped:
            # (a request in the pass running now still finishes it; the rest never runs)
            log.warning("worker.frontend_gone", extra={"fields": {
                "frontend": frontend, "orphaned_requests": dropped}})

    def news(self) -> Heartbeat | None:
        """A heartbeat for the other frontends when the request just admitted is work of at
        least NEWS_S here: they route by the queue each heard of at its last heartbeat (up to
        workers.heartbeat_interval_s old), and one sent a short request behind another's bulk
        one, to wait seconds while the other worker was idle (an outside check)."""
        tokens, self._admitted = self._admitted, 0
        return self.announcement() if self.newsworthy(tokens) else None

    def newsworthy(self, tokens: int) -> bool:
        """Whether a request of `tokens` is work of NEWS_S or more here: its admission is news
        to every frontend, and so is its end (gpu_workers.worker: a client sending one such
        request after another, through nginx to each frontend in turn, was refused 429 by the
        frontend that had heard of the previous one at admission and not since, an outside
        check)."""
        rate = self.backlog.rate
        return tokens > 0 and rate > 0.0 and tokens / rate >= NEWS_S

    def announcement(self) -> Heartbeat:
        """A heartbeat for every frontend, answering no ping (gpu_workers.sockets.ANNOUNCE)."""
        return self._beat(0.0)

    def on_submit(self, peer: bytes, msg: Submit) -> Error | None:
        self._look()  # a retry of a killed frontend's request: its queue is let go first
        if not self.status.ready or self.stopping.is_set():
            return Error(msg.seq, ErrorCode.UNAVAILABLE, "worker is loading or draining")
        for unloaded in self.status.unloaded:  # (a frontend routes none here: a late one)
            if unloaded.model == msg.model:
                return Error(msg.seq, ErrorCode.UNAVAILABLE, f"model {msg.model!r} did not "
                             f"load on this worker: {unloaded.error}")
        if msg.model not in self.specs:  # (a model loaded since its start is: the worker's)
            return Error(msg.seq, ErrorCode.UNKNOWN_MODEL, f"model {msg.model!r} is not served")
        if (msg.per_token or msg.raw) and self.specs[msg.model].task not in ("embedding", "null"):
            return Error(msg.seq, ErrorCode.INVALID, f"model {msg.model!r} is a "
                         f"{self.specs[msg.model].task} model: no "
                         f"{'token embeddings' if msg.per_token else 'raw embeddings'}")
        try:
            request = read_request(self.attachments, peer, msg, time.time(),
                                   self.specs[msg.model].width(msg.per_token))
        except ValueError as exc:  # handles that do not fit their arena: the frontend's fault
            return Error(msg.seq, ErrorCode.INVALID, f"bad buffers: {exc}")
        except OSError as exc:  # this worker's trouble (no file descriptor left to map the
            # arena with, ...), not the request's: another worker takes it (it was a 500
            # "bad buffers", not retried and not logged: an outside check)
            if time.monotonic() - self._unreadable_logged >= 1.0:  # a line a second at most
                self._unreadable_logged = time.monotonic()
                log.warning("worker.arena_unreadable", extra={"fields": {"frontend": next(
                    (i for i, (p, _) in self._frontends.items() if p == peer), None),
                    "error": str(exc)}})
            self._unmappable(peer, exc)
            return Error(msg.seq, ErrorCode.UNAVAILABLE, f"worker {self.index} cannot map the "
                         f"request's shared memory: {exc}")
        self._unmappable_since.pop(peer, None)
        n = request.remaining
        if n < self.cfg.frontends.spread_part_texts:
            self.small_at = request.arrived  # (time.time(), read for it above)
        limit = self.cfg.workers.queue_texts
        if msg.priority < 0:  # keep headroom for interactive work under a bulk flood
            limit = int(limit * self.cfg.workers.low_priority_queue_share)
        tokens = int(request.offsets[-1])
        if self.cfg.workers.refuse_past_deadline:
            # Only this thread admits, so what it reads here still holds when it adds below.
            refusal = self.backlog.refusal(msg.priority, tokens, request.arrived, msg.deadline)
            if refusal is not None:
                self.metrics.refused("deadline")
                return Error(msg.seq, ErrorCode.PAST_DEADLINE, f"{refusal.why}; retry later "
                             "(workers.refuse_past_deadline)", refusal.retry_after_s)
        with self._lock:
            queued = self.queued_texts - self.orphaned_texts
            if queued + n > limit:
                self.metrics.refused("queue_full")
                share = ("the share below-normal priority may fill "
                         "(workers.low_priority_queue_share) of " if msg.priority < 0 else "")
                # Until the texts over the bound have drained, at the queue's mean length
                over = (queued + n - limit) * self.backlog.queued() / max(queued, 1)
                return Error(msg.seq, ErrorCode.OVERLOADED,
                             f"worker queue full: {queued} texts queued, and this request's "
                             f"{n} would pass the {limit} of {share}workers.queue_texts; raise "
                             "it or add workers",
                             self.backlog.retry_after_s(int(over)))
            self.queued_texts += n
        request.tokens_left = tokens
        self.arrivals.arrived(request.arrived, alone=queued == 0)
        self._admitted = tokens  # for news(), which the socket thread calls next
        self.backlog.add(msg.priority, tokens)
        self._requests[(peer, msg.seq)] = request
        self.inbox.put(request)
        return None

    def _unmappable(self, peer: bytes, exc: OSError) -> None:
        if exc.errno not in EXHAUSTED:  # a file gone or not ours: not this process's state
            return  # (the frontend stops itself when its arena is deleted: own_files)
        now = time.monotonic()
        since = self._unmappable_since.setdefault(peer, now)
        if now - since >= UNMAPPABLE_EXIT_S and not self.unwell:
            self.unwell = (f"no request's shared memory from a frontend could be mapped for "
                           f"{UNMAPPABLE_EXIT_S:g} s: {exc}")
            log.error("worker.unwell", extra={"fields": {"worker": self.index,
                                                         "error": self.unwell}})

    def on_abort(self, peer: bytes, msg: Abort) -> None:
        request = self._requests.get((peer, msg.seq))
        if request is not None:
            request.aborted = True  # the model thread answers it before its next batch

    def on_control(self, peer: bytes, msg: Reload | Commit) -> None:
        self.inbox.put((peer, msg))  # the model thread owns the slots

    def finished(self, request: Request) -> None:
        """The model thread answered `request`: what it still held leaves the counts."""
        texts = request.offsets.shape[0] - 1
        with self._lock:  # as orphan(): a request is released once
            # Tokens computed after orphan() are taken off twice (by the pass, and by
            # orphan's release of what was left): given back here, as a negative done.
            self.backlog.done(request.msg.priority,
                              request.tokens_left - request.released_tokens)
            request.tokens_left = 0
            self._requests.pop((request.peer, request.msg.seq), None)
            self.queued_texts -= texts
            if request.orphaned:
                self.orphaned_texts -= texts


def running(pid: int) -> bool:
    """Whether process `pid` runs (not gone, not a zombie waiting for supervisord to reap
    it), as /proc shows it; False also where this worker cannot see it (another pid
    namespace, no /proc), and such a frontend is then judged by its pings alone. True where
    this worker is out of descriptors: it cannot tell, and False would drop a live frontend's
    queued requests (an outside check)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError as exc:
        return exc.errno in (errno.EMFILE, errno.ENFILE)
    return stat.rpartition(")")[2].split()[:1] not in (["Z"], ["X"], [])
