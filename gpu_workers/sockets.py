"""The worker's socket thread: it never waits on the model.

It owns the ROUTER socket the frontends connect to and an inproc PULL socket on which the model
thread pushes finished replies (ZeroMQ sockets are not thread-safe, so each thread keeps its own).
Pings are answered here at once, so heartbeats flow even in the middle of a long batch. Reload
and Commit go to the model thread, which owns the model slots.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

import zmq

from shmserve import wire
from shmserve.protocol import (Abort, Closing, ClosingSeen, Commit, Error, ErrorCode,
                               Heartbeat, Ping, Reload, Submit)
from shmserve.wire import WireError

log = logging.getLogger("shmserve.worker")

REPLIES = "inproc://replies"
# What the model thread pushes, one frame, where its models changed (a reload staged or
# committed) or it became ready or began to drain: a heartbeat goes to every frontend at once
ANNOUNCE = b"announce"
POLL_MS = 100
FAREWELL_S = 1.0  # at most, for the frontends to say they read this worker's last message


class SocketThread(threading.Thread):
    def __init__(self, ctx: zmq.Context, endpoint: str,
                 on_submit: Callable[[bytes, Submit], Error | None],
                 on_abort: Callable[[bytes, Abort], None],
                 heartbeat: Callable[[Ping, bytes], Heartbeat],
                 on_control: Callable[[bytes, Reload | Commit], None],
                 tick: Callable[[], None] = lambda: None,
                 news: Callable[[], Heartbeat | None] = lambda: None, worker: int = 0,
                 news_now: Callable[[], Heartbeat] | None = None) -> None:
        super().__init__(name="sockets", daemon=True)
        self._worker = worker
        self._ctx = ctx
        self._endpoint = endpoint
        self._on_submit = on_submit
        self._on_abort = on_abort
        self._heartbeat = heartbeat
        self._on_control = on_control
        self._tick = tick  # every loop round (at most POLL_MS apart): the watch on frontends
        self._news = news  # after an admitted Submit: a heartbeat for the other frontends, or None
        self._news_now = news_now  # a heartbeat for every frontend (ANNOUNCE)
        # The frontends that ping this worker, by index: a restarted frontend's new socket
        # replaces its old one (a set of every socket ever seen grew with each restart, and
        # news went to all of them; a review).
        self._peers: dict[int, bytes] = {}
        self._next_look = 0.0  # time.monotonic() of the next look at the ipc file (_keep_file)
        self._halt = threading.Event()
        self._answered = True
        self.bound = threading.Event()
        self.failure: BaseException | None = None
        # Bind the reply socket now so the model thread may connect before this thread runs.
        self._replies = ctx.socket(zmq.PULL)
        self._replies.bind(REPLIES)

    def stop(self, answered: bool = True) -> None:
        """`answered`: what the model thread took was answered or never ran (Closing)."""
        self._answered = answered
        self._halt.set()

    def run(self) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        try:
            router.setsockopt(zmq.LINGER, 1000)
            router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished peer's replies are dropped
            router.setsockopt(zmq.RCVHWM, 0)
            router.setsockopt(zmq.SNDHWM, 0)
            router.bind(self._endpoint)
            self.bound.set()
            self._loop(router)
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread, which exits
            self.failure = exc
            log.exception("socket thread failed")
        finally:
            router.close(linger=1000)
            self._replies.close(linger=0)
            if self.bound.is_set() and self._endpoint.startswith("ipc://"):
                # libzmq leaves a bound ipc socket's file behind: a stop (SIGTERM) must not
                # (`shmserve down` swept them; a SIGTERM to supervisord or a pod's stop left
                # them). The next worker of this index binds its own file anyway.
                Path(self._endpoint.removeprefix("ipc://")).unlink(missing_ok=True)

    def _loop(self, router: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._replies, zmq.POLLIN)
        while not self._halt.is_set():
            self._tick()
            self._keep_file(router)
            for sock, _ in poller.poll(POLL_MS):
                if sock is self._replies:
                    # Send every reply already queued before reading more requests.
                    while True:
                        try:
                            frames = self._replies.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if frames == [ANNOUNCE]:
                            self._announce(router)
                        else:
                            router.send_multipart(frames)
                else:
                    self._handle(router, router.recv_multipart(copy=True))
        # Stopped (Worker.close, after the model thread's last replies): what it sent before
        # still goes out. A worker exiting on a device error lost its pass's 500 this way when
        # the halt came before the next poll, and the frontend retried the request elsewhere.
        while True:
            try:
                router.send_multipart(self._replies.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        self._farewell(router)

    def _keep_file(self, router: zmq.Socket) -> None:
        """Every second: the ipc socket's file, deleted under this worker (by hand, a cleaner
        of the run directory), is bound again. The frontends connected keep their connections,
        but one started after it found no worker, for good (an outside check)."""
        now = time.monotonic()
        if now < self._next_look or not self._endpoint.startswith("ipc://"):
            return
        self._next_look = now + 1.0
        if os.path.exists(self._endpoint.removeprefix("ipc://")):
            return
        log.error("worker.socket_lost", extra={"fields": {
            "worker": self._worker, "endpoint": self._endpoint, "action": "bound again"}})
        try:
            router.unbind(self._endpoint)
        except zmq.ZMQError:
            pass
        router.bind(self._endpoint)

    def _farewell(self, router: zmq.Socket) -> None:
        """Tell each frontend that this worker sends nothing more (Closing), and keep the
        connection open until each has read that, so every reply before it too (ClosingSeen),
        or FAREWELL_S has passed (a frontend stopped or gone). A frontend's socket drops what
        it has not read when the connection drops (see protocol.Closing).

        A Submit that came in meanwhile is refused first (UNAVAILABLE: it ran nothing, another
        worker takes it); after Closing, a frontend sends what it still waits for elsewhere
        itself. Pings go unanswered."""
        while router.poll(0, zmq.POLLIN):
            frames = router.recv_multipart()
            for msg in self._decoded(frames):
                if isinstance(msg, Submit):
                    refusal = Error(msg.seq, ErrorCode.UNAVAILABLE, "worker is stopping")
                    router.send_multipart([frames[0], *wire.encode(refusal)])
        waiting = set()
        closing = wire.encode(Closing(self._worker, os.getpid(), self._answered))
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a frontend gone is skipped, not waited for
        for peer in self._peers.values():
            try:
                router.send_multipart([peer, *closing], zmq.NOBLOCK)
            except zmq.ZMQError:  # EHOSTUNREACH: not connected
                continue
            waiting.add(peer)
        deadline = time.monotonic() + FAREWELL_S
        while waiting and (left := deadline - time.monotonic()) > 0:
            if not router.poll(int(left * 1000) + 1, zmq.POLLIN):
                break
            frames = router.recv_multipart()
            if any(isinstance(msg, ClosingSeen) for msg in self._decoded(frames)):
                waiting.discard(frames[0])
        if waiting:
            log.warning("worker.farewell_unread", extra={"fields": {"frontends": len(waiting)}})

    def _announce(self, router: zmq.Socket) -> None:
        """A heartbeat to every frontend now, not at its next ping: the models a worker serves
        changed (a reload committed), and /info, /admin/models and KServe's model versions
        read them from heartbeats (up to workers.heartbeat_interval_s behind the reload's
        answer: an outside check)."""
        if self._news_now is None:
            return
        frames = wire.encode(self._news_now())
        for peer in self._peers.values():  # (a peer gone: ROUTER drops it)
            router.send_multipart([peer, *frames])

    @staticmethod
    def _decoded(frames: list[bytes]) -> list:
        try:
            return wire.decode_all(frames[1:])
        except WireError:
            return []

    def _handle(self, router: zmq.Socket, frames: list[bytes]) -> None:
        peer = frames[0]
        try:
            messages = wire.decode_all(frames[1:])  # what a frontend sent in one loop turn
        except WireError as exc:
            messages = [exc]
        for msg in messages:
            if isinstance(msg, WireError):
                log.warning("dropped a malformed message: %s", msg)
            else:
                self._dispatch(router, peer, msg)

    def _dispatch(self, router: zmq.Socket, peer: bytes, msg) -> None:
        if isinstance(msg, Ping):
            if msg.frontend >= 0:
                self._peers[msg.frontend] = peer
            router.send_multipart([peer, *wire.encode(self._heartbeat(msg, peer))])
        elif isinstance(msg, Submit):
            error = self._on_submit(peer, msg)
            if error is not None:
                router.send_multipart([peer, *wire.encode(error)])
            elif (beat := self._news()) is not None:
                frames = wire.encode(beat)
                for other in self._peers.values():  # (a peer gone: ROUTER drops it)
                    if other != peer:
                        router.send_multipart([other, *frames])
        elif isinstance(msg, Abort):
            self._on_abort(peer, msg)
        elif isinstance(msg, (Reload, Commit)):
            self._on_control(peer, msg)
        else:
            log.warning("unexpected %s from a frontend", type(msg).__name__)
