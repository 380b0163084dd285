"""The frontend's client of the workers: `submit`, `abort`, `close`, and who is alive.

One DEALER socket per worker. What a turn of the event loop sends to a worker goes as one
ZeroMQ message, and a worker answers a batch's requests the same way (`shmserve.wire`). One
receive task per socket resolves a map of pending futures (a message whose handling fails is
logged, and the task goes on); one heartbeat task pings every worker and declares a worker dead
after `workers.heartbeat_timeout_s` of silence, or when its heartbeat shows a new pid (and, after
`workers.hung_kill_s`, kills it: frontend.watchdog); one monitor task per socket declares it
dead the moment ZeroMQ reports the connection dropped, so `/ready` and routing stop counting it
at once. A dead worker's pending requests all fail with `WorkerGone` at once, and so do they if
a receive task dies: nothing waits forever.

Each pending entry carries `on_settled`, called exactly once when the worker can no longer touch
the request's shared-memory slot (its terminal reply arrived, or it was declared dead).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from dataclasses import replace
from typing import Callable

import zmq
import zmq.asyncio
from zmq.utils import monitor as zmq_monitor

from frontend import metrics
from frontend.links import (Pending, Stopped, WorkerClosed, WorkerGone, WorkerLink, dealer,
                            send_now)
from frontend.watchdog import Watchdog
from shmserve import admission, processes, state, topology, wire
from shmserve.config import Config
from shmserve.protocol import (PROTOCOL_VERSION, Abort, Closing, ClosingSeen, Commit, Error,
                               Heartbeat, Ping, Reload, ReloadDone, Result, Submit)
from shmserve.wire import WireError

log = logging.getLogger("shmserve.frontend")


DROP_GRACE_S = 0.1  # after a dropped connection, for the replies already on the socket
DROP_GRACE_ROUNDS = 20  # graces at most while replies wait unread on the socket (2 s)
LOST_IDS_LOGGED = 100  # ids of its requests on a frontend.worker_lost line, at most
FIRST_HEARD_WINDOW_S = 5.0  # a new frontend's /ready waits for first heartbeats this long


class WorkerPool:
    def __init__(self, cfg: Config, frontend: int = 0) -> None:
        self.cfg = cfg
        self.frontend = frontend  # this frontend's index, for its metrics
        self._ctx = zmq.asyncio.Context()
        self._seq = itertools.count(1)
        self.links = [self._link(i, d) for i, d in enumerate(topology.worker_devices(cfg))]
        self._turn = 0  # pick's tie-break
        self._tasks: list[asyncio.Task] = []
        self._changed = asyncio.Event()  # set whenever a worker becomes ready
        self.restarts_seen = 0
        self._ever_ready: set[int] = set()  # workers seen ready since this frontend started
        # Every worker has been ready once since `up`: before this frontend started (it was
        # restarted into a running deployment, not started with it), or since (`started`).
        self._past_start = state.has_started(cfg)
        self._heard_all = asyncio.Event()  # every worker has been heard from once
        self._born = time.monotonic()
        self.watchdog = Watchdog(cfg, frontend)

    def _link(self, index: int, device: str) -> WorkerLink:
        endpoint = topology.worker_endpoint(self.cfg, index)
        return WorkerLink(index, endpoint, dealer(self._ctx, endpoint),
                          "cpu" if device == topology.CPU else "gpu")

    async def start(self) -> None:
        for link in self.links:
            self._tasks.append(asyncio.create_task(self._receive(link), name=f"recv-{link.index}"))
            self._tasks.append(asyncio.create_task(self._monitor(link), name=f"mon-{link.index}"))
        self._tasks.append(asyncio.create_task(self._heartbeats(), name="heartbeats"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for link in self.links:
            self._fail_pending(link, "frontend is shutting down", hold=False)
            link.socket.close(linger=0)  # close sockets before terminating the context
        self._ctx.term()

    # ---- state ------------------------------------------------------------------------------

    async def first_heard(self) -> None:
        """In a new frontend's first seconds, until every worker has been heard from once (at
        most a heartbeat interval and a little): a restarted frontend's first /ready, asked
        before any heartbeat, said "loading" (503) in a rolling restart that keeps every
        worker ready (an outside check: one probe per restarted frontend)."""
        if self._heard_all.is_set() or time.monotonic() - self._born > FIRST_HEARD_WINDOW_S:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._heard_all.wait(),
                                   self.cfg.workers.heartbeat_interval_s + 0.25)

    @property
    def all_ready(self) -> bool:
        return all(link.ready for link in self.links)

    @property
    def started(self) -> bool:
        """Past the deployment's start: every configured worker has been ready at least once
        since `up`, as this frontend saw or as the run directory says (state.has_started: a
        frontend restarted into a running deployment). A frontend restarted while a worker was
        down waited for that worker, and its /ready said 503 "loading" where the others said
        200 "degraded" (and `restart frontends` could not finish). It judged a worker ready
        when first heard from as the sign of a running deployment before, and a fresh `up`
        whose small model one worker had loaded before the frontends listened said "degraded"
        (200) while another worker still loaded (an outside check)."""
        return self._past_start

    def ready_links(self, model: str) -> list[WorkerLink]:
        return [link for link in self.links
                if link.ready and any(m.name == model for m in link.beat.models)]

    def pick(self, model: str, avoid: WorkerLink | None = None) -> WorkerLink | None:
        """The ready worker with the least work in tokens (WorkerLink.load; a pass's time grows
        with its tokens far more than its texts: CPU ~0.15 ms a token, ~3 ms a pass). Ties
        (idle workers) go round, or the lowest index took all and the others sat cold.
        `avoid` (one that turned the request away) only when no other is ready."""
        links = self.ready_links(model)
        if not links:
            return None
        self._turn, n, now = self._turn + 1, len(self.links), time.monotonic()
        return min(links, key=lambda link: (link is avoid, link.load(now),
                                            (link.index - self._turn) % n))

    def idle(self, model: str) -> int:
        """Ready workers of `model` with no work as `pick` counts it (frontend.dispatch)."""
        now = time.monotonic()
        return sum(1 for link in self.ready_links(model) if link.load(now) <= 0)

    async def wait_for_worker(self, model: str, timeout: float,
                              avoid: WorkerLink | None = None) -> WorkerLink | None:
        deadline = time.monotonic() + timeout
        while (link := self.pick(model, avoid)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._changed.clear()
            try:  # asyncio.timeout, not wait_for: a cancel as the event is set is not lost
                async with asyncio.timeout(left):
                    await self._changed.wait()
            except TimeoutError:
                return None
        return link

    def model_info(self, model: str):
        """What the workers last said of `model`: a ready worker's first, then one naming a
        revision (a restarting one names none: /info said null, an outside check)."""
        found = [(link.ready, bool(info.revision), -i, info)
                 for i, link in enumerate(self.links) if link.beat is not None
                 for info in link.beat.models if info.name == model]
        return max(found, key=lambda each: each[:3])[3] if found else None

    # ---- requests ---------------------------------------------------------------------------

    def next_seq(self) -> int:
        return next(self._seq)

    def behind(self, model: str, priority: int, deadline: float, tokens: int = 0
               ) -> admission.Refusal | None:
        """Why every ready worker of `model` would refuse the request by its admission rule,
        judged from its last heartbeat (shmserve.admission.heard_refusal); None: send it."""
        return admission.heard_refusal(((link.beat, link.last_beat)
                                        for link in self.ready_links(model)),
                                       priority, tokens, deadline)

    def submit(self, link: WorkerLink, msg: Submit | Reload | Commit, tokens: int,
               on_settled: Callable[[], None]) -> asyncio.Future:
        """Send `msg`; the future resolves to its reply (Result or Error for a Submit,
        ReloadDone for a Reload or Commit), or fails with WorkerGone."""
        future = asyncio.get_running_loop().create_future()
        link.pending[msg.seq] = Pending(future, tokens, on_settled,
                                        getattr(msg, "request_id", ""))
        link.outstanding += tokens
        self._post(link, msg)
        return future

    def abort(self, link: WorkerLink, seq: int) -> None:
        if seq in link.pending:  # after its Submit, in the same outbox; if gone, its death
            self._post(link, Abort(seq))  # settles it

    def stop_waiting(self, why: str) -> int:
        """The end of this frontend's drain: every request still waiting on a worker fails
        with Stopped (a 503 to its client), and its worker is told to drop it. Their slots
        stay held until the workers answer the aborts, as a worker may be writing them. How
        many there were."""
        stopped = 0
        for link in self.links:
            for seq, entry in list(link.pending.items()):
                if entry.future.done():
                    continue
                self.abort(link, seq)
                entry.future.set_exception(Stopped(why))
                stopped += 1
        return stopped

    def mark_unready(self, link: WorkerLink) -> None:
        """The worker answered that it is loading or draining: route around it until its next
        heartbeat says otherwise."""
        if link.beat is not None and link.beat.ready:
            link.beat = replace(link.beat, ready=False)

    def _post(self, link: WorkerLink, msg: Submit | Reload | Commit | Abort) -> None:
        """Queue `msg` for `link`; every message queued in this turn of the event loop goes out
        as one ZeroMQ message (wire.decode_all), so a burst of requests costs one send and one
        wake-up of the worker, not one each."""
        if not link.outbox:
            asyncio.get_running_loop().call_soon(self._flush, link)
        link.outbox.extend(wire.encode(msg))
        if isinstance(msg, Submit):
            link.unsent.add(msg.seq)

    def _flush(self, link: WorkerLink) -> None:
        frames, link.outbox = link.outbox, []
        if frames and not send_now(link.socket, frames):
            # Not connected (IMMEDIATE): the worker is gone and never saw these; its pending
            # requests (these among them) fail with WorkerGone and move to another worker.
            self._declare_dead(link, "connection lost")
        link.unsent.clear()

    # ---- tasks ------------------------------------------------------------------------------

    async def _receive(self, link: WorkerLink) -> None:
        try:
            while True:
                frames = await link.socket.recv_multipart()
                try:
                    messages = wire.decode_all(frames)  # a batch's replies come together
                except WireError as exc:
                    messages = [exc]
                for msg in messages:
                    try:
                        self._on_message(link, msg)
                    except Exception:  # one message's failure must not end the task, which
                        # left the worker unseen until this frontend restarted (outside check)
                        log.exception("frontend: a message from worker %d failed", link.index)
        except asyncio.CancelledError:
            raise
        except BaseException:
            log.exception("receive task of worker %d failed", link.index)
            link.alive = False
            self._fail_pending(link, "frontend receive task failed")
            raise

    def _on_message(self, link: WorkerLink, msg) -> None:
        if isinstance(msg, WireError):
            log.warning("dropped a malformed reply from worker %d: %s", link.index, msg)
        elif isinstance(msg, Heartbeat):
            self._on_heartbeat(link, msg)
        elif isinstance(msg, (Result, Error, ReloadDone)):
            self._settle(link, msg)
        elif isinstance(msg, Closing):
            self._on_closing(link, msg)

    async def _monitor(self, link: WorkerLink) -> None:
        """Connection events of `link`'s socket: a drop means the worker's process is gone (its
        heartbeats would say so only after `workers.heartbeat_timeout_s`)."""
        events = link.socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                                | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            while True:
                event = zmq_monitor.parse_monitor_message(await events.recv_multipart())
                if event["event"] == zmq.EVENT_CONNECTED:
                    link.dropped_pid = None  # whoever answers now is alive
                elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._ping(link)  # so it knows this frontend before its next round
                elif link.alive:
                    # A worker that stops says so first (Closing: it is not alive by now);
                    # one that crashed or was killed may have answered just before: what it
                    # held fails a moment later, once the replies still readable are read.
                    link.dropped_pid = link.beat.pid if link.beat is not None else None
                    self._declare_dead(link, "connection dropped", grace=DROP_GRACE_S)
        finally:
            link.socket.disable_monitor()
            events.close(linger=0)

    def _on_closing(self, link: WorkerLink, msg: Closing) -> None:
        """The worker's last message: every reply it owed came before it, so what is still
        pending here never ran and never will (WorkerClosed: the dispatcher sends it elsewhere,
        not counted as a lost worker's; WorkerGone when the worker failed unforeseen, and may
        have run it). Said back at once: the worker holds its connection open until it hears
        this (a dropped connection loses what was not yet read)."""
        send_now(link.socket, wire.encode(ClosingSeen(self.frontend)))
        link.dropped_pid = msg.pid  # its process reads no slot any more
        if link.alive:
            link.alive = False
            log.log(logging.INFO if msg.answered else logging.WARNING, "frontend.worker_closed",
                    extra={"fields": {"worker": link.index, "worker_pid": msg.pid,
                                      "pending": len(link.pending), "answered": msg.answered}})
        self._fail_pending(link, f"worker {link.index} {'stopped' if msg.answered else 'failed'}",
                           hold=False, error=WorkerClosed if msg.answered else WorkerGone)
        link.release_held(of=msg.pid)  # failed over earlier, while it was silent

    def _settle(self, link: WorkerLink, msg: Result | Error | ReloadDone) -> None:
        pending = link.pending.pop(msg.seq, None)
        if pending is None:
            # Its worker was declared dead and the request moved on; a late answer from a
            # worker that was only silent says it is done with the slot.
            held = link.held.pop(msg.seq, None)
            if held is not None:
                held[1].on_settled()
            return
        link.outstanding -= pending.tokens
        pending.on_settled()
        if not pending.future.done():
            pending.future.set_result(msg)

    def _on_heartbeat(self, link: WorkerLink, beat: Heartbeat) -> None:
        heard, link.protocol = link.protocol, beat.protocol_version  # on /ready
        if beat.protocol_version != PROTOCOL_VERSION:
            # Once, not every heartbeat (a frontend restarted on pulled code logged it five
            # times a second: an outside check).
            if link.alive or heard != beat.protocol_version:
                log.error("worker %d speaks protocol %d, this frontend %d; ignoring it (an "
                          "upgrade half taken? README: Upgrading shmserve)",
                          link.index, beat.protocol_version, PROTOCOL_VERSION)
            link.alive = False
            return
        if beat.pid == link.dropped_pid:
            return  # sent before its process died, read after the drop
        self.watchdog.heard(link.index, beat)
        if link.held and (link.beat is None or link.beat.pid != beat.pid):
            link.release_held()  # a new process: the one that held them is gone
        if link.beat is not None and link.beat.pid != beat.pid:
            self.restarts_seen += 1
            metrics.WORKER_RESTARTS.labels(str(self.frontend), str(link.index)).inc()
            self._fail_pending(link, f"worker {link.index} restarted")
            log.info("frontend.worker_restarted", extra={"fields": {"worker": link.index,
                                                                    "worker_pid": beat.pid}})
        was_ready = link.ready
        if beat.failure and beat.pid != link.failed_pid:  # a load failed (gpu_workers.worker)
            # the worker's own count where it has more: a frontend started after some of its
            # failures said fewer than its log (an outside check: 1 against 3)
            link.failed_pid = beat.pid
            link.failed_loads = max(link.failed_loads + 1,
                                    state.load_failures(self.cfg, link.index))
            link.load_error = beat.failure
            log.warning("frontend.worker_load_failed", extra={"fields": {
                "worker": link.index, "worker_pid": beat.pid, "failed_loads": link.failed_loads,
                "error": beat.failure}})
        link.beat, link.last_beat, link.alive = beat, time.monotonic(), True
        if not self._heard_all.is_set() and all(x.beat is not None for x in self.links):
            self._heard_all.set()
        if link.ready and not was_ready:
            self._ever_ready.add(link.index)
            link.failed_loads, link.load_error, link.failed_pid = 0, None, None
            if not self._past_start and len(self._ever_ready) == len(self.links):
                self._past_start = True
                try:  # for the frontends restarted later (`started`)
                    state.mark_started(self.cfg)
                except OSError as exc:
                    log.warning("frontend: cannot mark the deployment started: %s", exc)
            log.info("frontend.worker_ready", extra={"fields": {"worker": link.index,
                                                                "device": beat.device}})
            self._changed.set()

    async def _heartbeats(self) -> None:
        while True:
            try:
                self._round(time.monotonic())
            except Exception:  # a round that fails must not end the pings: the workers would
                # SIGKILL this frontend after frontends.hung_kill_s of silence
                log.exception("frontend: heartbeat round failed")
            await asyncio.sleep(self.cfg.workers.heartbeat_interval_s)

    def _round(self, now: float) -> None:
        """One heartbeat round: ping every worker, judge the silent ones. Silence counts from
        this frontend's own resumption when it was itself paused (its round late by more than
        the heartbeat timeout: the watchdog's `awake_since`, which the hung kill counts from
        too): it heard nothing meanwhile through no fault of the workers, and once declared
        every worker lost after its own 4 s pause and sent their requests elsewhere."""
        self.watchdog.tick(now)
        awake_since = self.watchdog.hung.awake_since
        timeout = self.cfg.workers.heartbeat_timeout_s
        for link in self.links:
            self._ping(link)  # silence decides below
            silent = now - max(link.last_beat, awake_since)
            if link.alive and silent > timeout:
                self._declare_dead(link, f"silent for {silent:.1f}s")
            self.watchdog.check(link, now)  # silent much longer: SIGKILL (hung_kill_s)
            if link.held:
                link.release_held(only_gone=True)

    def _ping(self, link: WorkerLink) -> None:
        send_now(link.socket, wire.encode(Ping(time.time(), self.frontend, os.getpid())))

    def _declare_dead(self, link: WorkerLink, reason: str, grace: float = 0.0) -> None:
        """Route nothing more to `link`; its pending requests fail now, or after `grace`
        seconds unless it came back meanwhile (a new worker's first heartbeat fails the old
        one's requests itself)."""
        link.alive = False
        log.warning("frontend.worker_lost", extra={"fields": {
            "worker": link.index, "reason": reason, "pending": len(link.pending),
            "request_ids": [p.request_id for p in itertools.islice(
                link.pending.values(), LOST_IDS_LOGGED) if p.request_id]}})
        message = f"worker {link.index} lost: {reason}"
        if not grace:
            self._fail_pending(link, message)
            return

        loop = asyncio.get_running_loop()

        def fail_unless_back(rounds: int = 1) -> None:
            if link.alive:
                return
            # Replies the worker sent before it went may still be unread: this frontend's
            # receive task later than the grace on a loaded machine. (ZeroMQ drops what is
            # unread once it has processed the drop, which is why a stopping worker waits for
            # its Closing to be read.)
            if rounds < DROP_GRACE_ROUNDS and link.socket.get(zmq.EVENTS) & zmq.POLLIN:
                loop.call_later(grace, fail_unless_back, rounds + 1)
                return
            self._fail_pending(link, message)

        loop.call_later(grace, fail_unless_back)

    def _fail_pending(self, link: WorkerLink, reason: str, hold: bool = True,
                      error: type[WorkerGone] = WorkerGone) -> None:
        """Fail `link`'s requests over (`error`, WorkerGone or WorkerClosed: the dispatcher
        resubmits them elsewhere).
        A slot is released now only where no worker process can touch it: its Submit was never
        sent, or the worker's process is gone; otherwise the worker may just have been silent
        (stopped, swapped out) and may still read its token ids and write its rows, so the slot
        is held until it answers or its process ends (`WorkerLink.release_held`), not given
        to another request."""
        pid = link.beat.pid if link.beat is not None else None
        may_live = hold and pid is not None and pid != link.dropped_pid and \
            processes.alive(pid)  # before the swap: a raise here left the requests unfailed
        pending, link.pending, link.outstanding, link.outbox = link.pending, {}, 0, []
        unsent, link.unsent = link.unsent, set()
        for seq, entry in pending.items():
            if may_live and seq not in unsent:
                link.held[seq] = (pid, entry)
                # Should it resume: drop the request if it has not started, and answer, which
                # releases the slot; the request itself runs elsewhere.
                self._post(link, Abort(seq))
            else:
                entry.on_settled()
            if not entry.future.done():
                entry.future.set_exception(error(reason))
