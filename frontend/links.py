"""What the frontend's worker pool (frontend.pool) keeps of each worker, and its socket helpers:
a `WorkerLink` per worker (its socket, last heartbeat, pending requests, the slots it may still
touch), a `Pending` entry per request, and the exceptions a request's future fails with."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

import zmq
import zmq.asyncio

from shmserve import processes
from shmserve.protocol import Heartbeat, Unloaded


class WorkerGone(Exception):
    """The worker a request was sent to died (or restarted) before answering."""


class WorkerClosed(WorkerGone):
    """The worker said it sends nothing more (protocol.Closing) with the request unanswered:
    it ran none of it, and another worker takes it as from a draining one."""


class Stopped(Exception):
    """This frontend stops: its drain ended before the worker answered (`stop_waiting`)."""


@dataclass(slots=True, eq=False)
class Pending:
    future: asyncio.Future
    tokens: int
    on_settled: Callable[[], None]
    request_id: str = ""  # a Submit's (the log line of a lost worker names them)


@dataclass(slots=True, eq=False)
class WorkerLink:
    index: int
    endpoint: str
    socket: zmq.asyncio.Socket
    compute_type: str = "cpu"  # cpu or gpu: TEI's X-Compute-Type of what it answers
    beat: Heartbeat | None = None
    last_beat: float = 0.0  # monotonic
    alive: bool = False
    pending: dict[int, Pending] = field(default_factory=dict)
    outstanding: int = 0  # tokens submitted here and not yet answered
    protocol: int | None = None  # the version its last heartbeat named (shmserve.protocol)
    dropped_pid: int | None = None  # the worker whose connection dropped: its heartbeats still
                                    # queued on the socket are stale
    outbox: list[bytes] = field(default_factory=list)  # messages to send at the end of this
                                                       # loop turn, as (kind, body) frame pairs
    unsent: set[int] = field(default_factory=set)  # the seqs in the outbox
    # Loads failed in a row (a heartbeat's `failure`, once per process) since it was last ready,
    # the last one's error, and the process that failed it
    failed_loads: int = 0
    load_error: str | None = None
    failed_pid: int | None = None
    held: dict[int, tuple[int, Pending]] = field(default_factory=dict)  # seq -> (pid, entry):
    # requests failed over while the process they went to may still live (silent, not gone):
    # their slots stay held until it answers them or is gone, since it may still read the
    # token ids and write the output rows

    @property
    def ready(self) -> bool:
        return self.alive and self.beat is not None and self.beat.ready

    def load(self, now: float) -> float:
        """A ready worker's work in tokens at `now` (time.monotonic()), as a frontend routes by
        it (WorkerPool.pick): the larger of what this frontend sent it unanswered and what it
        last reported queued (every frontend's) less what it drained since at its speed.
        (This frontend's own first sent a query to a worker holding another frontend's 56,000
        tokens over one holding its own 10: it waited 7-9 s, an outside check.)"""
        return max(self.outstanding,
                   self.beat.queued - self.beat.drain_rate * (now - self.last_beat))

    @property
    def hung(self) -> bool:
        """Lost (silent past `workers.heartbeat_timeout_s`) while its process lives: hung or
        SIGSTOPped. The scrape's shmserve_worker_ready reads 0 for it, which its own gauge left
        at 1 until the watchdog killed it; not for a process gone, whose gauge went with it
        and whose successor's own (0 while loading) is the truth, though this frontend may
        not have heard it yet (a scrape a heartbeat after a restart read 0: a CI run)."""
        return (self.beat is not None and not self.alive and self.beat.pid != self.dropped_pid
                and processes.alive(self.beat.pid))

    @property
    def unloaded(self) -> tuple[Unloaded, ...]:
        """Its models that did not load while others did (it serves those and tries these
        again: gpu_workers.loading.Retries), as its last heartbeat said while it lives."""
        return self.beat.unloaded if self.alive and self.beat is not None else ()

    def release_held(self, only_gone: bool = False, of: int | None = None) -> None:
        """Release the slots held for worker processes that are gone (`only_gone`), for
        process `of` (it said it reads none any more: Closing), or all. Each pid is looked up
        once: up to frontends.max_inflight entries share one, and a lookup each held the event
        loop ~46 ms a heartbeat round (1,024; a review)."""
        pids = {pid for pid, _ in self.held.values()}
        gone = ({of} & pids if of is not None
                else {pid for pid in pids if not processes.alive(pid)} if only_gone else pids)
        for seq, (pid, entry) in list(self.held.items()):
            if pid in gone:
                del self.held[seq]
                entry.on_settled()


def did_not_load(links: list[WorkerLink], model: str) -> tuple[str, float]:
    """Why `model` is not served by the workers that failed to load it (one clause per
    worker, "" where none did): those serving their other models, and those none of whose
    models loaded, backing off or restarting; and the seconds until the first tries again."""
    failed = [each for link in links if (each := failure(link, model))]
    why = "; ".join(f"worker {i}: {error} ({n} failed load(s) in a row)"
                    for i, error, n, _ in failed)
    return why, min((each[3] for each in failed), default=0.0)


def failure(link: WorkerLink, model: str) -> tuple[int, str, int, float] | None:
    """How worker `link` failed to load `model`, if it did: (worker, error, failures in a row,
    seconds to its next try): from its heartbeats' unloaded models, or, none of its models
    loaded, its start's error (also between its starts)."""
    for u in link.unloaded:
        if u.model == model:
            return link.index, u.error, u.failures, u.retry_in_s
    if link.load_error and not link.ready and link.beat is not None and any(
            i.name == model for i in link.beat.models):
        return link.index, link.load_error, link.failed_loads, 1.0
    return None


def unit_state(link: WorkerLink, unit: str) -> str:
    """What worker `link` says of model `unit` (a model, or an A/B arm MODEL@VARIANT): down,
    failed (it serves its other models and tries this one again), the heartbeat's state of it
    (ready, loading into standby, staged) once the worker is ready, else loading."""
    if not link.alive:
        return "down"
    if any(u.model == unit for u in link.unloaded):
        return "failed"
    info = next((m for m in link.beat.models if m.name == unit), None) if link.beat else None
    return info.state if link.ready and info is not None else "loading"


def dealer(ctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    """A frontend's socket to one worker, connected to `endpoint`."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue messages for a worker not connected
    # A restarted worker is found within 250 ms of binding (1 s: a small model's worker was
    # ready, and announced it to no frontend, before they had connected)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 250)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)
    return sock


def send_now(sock: zmq.asyncio.Socket, frames: list[bytes]) -> bool:
    """Send without waiting; False when the peer is not connected (zmq.Again).

    zmq.asyncio reports a NOBLOCK send's failure through the returned future, not by raising,
    and that future is already done."""
    future = sock.send_multipart(frames, flags=zmq.NOBLOCK)
    if not future.done():
        return True
    error = future.exception()
    if error is None:
        return True
    if isinstance(error, zmq.Again):
        return False
    raise error


def consume(future: asyncio.Future) -> None:
    """A done-callback for a reply future nobody awaits any more: its exception is marked
    retrieved, so asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()
