"""The worker's socket thread: who hears a worker's news."""

import os
import time

import zmq

from gpu_workers import sockets as sockets_module
from gpu_workers.sockets import SocketThread
from shmserve import wire
from shmserve.protocol import (Closing, ClosingSeen, Error, ErrorCode, Heartbeat, Ping,
                               Submit)


class Router:
    def __init__(self) -> None:
        self.sent: list[bytes] = []  # the peer each message went to

    def send_multipart(self, frames) -> None:
        self.sent.append(frames[0])


def test_news_goes_to_each_frontends_current_socket_only():
    """Every socket identity that ever pinged was kept, so a worker sent its news to each
    restarted frontend's old sockets too, for its whole life (a review)."""
    beat = Heartbeat(3, 0, 1, True, "cpu", (), 0, 64, 0.0, 0.0)
    ctx = zmq.Context()
    thread = SocketThread(ctx, "inproc://unused", lambda peer, msg: None, lambda peer, msg: None,
                          lambda ping, peer: beat, lambda peer, msg: None,
                          news=lambda: beat)
    try:
        router = Router()
        for peer, frontend in ((b"old-0", 0), (b"new-0", 0), (b"fe-1", 1), (b"probe", -1)):
            thread._dispatch(router, peer, Ping(0.0, frontend, 0))
        router.sent.clear()
        thread._dispatch(router, b"fe-1", Submit(1, "r", "m", None, None, None, 0.0, 0, None))
        assert router.sent == [b"new-0"]
    finally:
        thread._replies.close(linger=0)
        ctx.term()


def _serving(tmp_path, monkeypatch, farewell_s: float = 5.0):
    """A socket thread bound on an ipc endpoint, and a frontend's DEALER that pinged it."""
    from gpu_workers import sockets

    monkeypatch.setattr(sockets, "FAREWELL_S", farewell_s)
    beat = Heartbeat(3, 0, 1, True, "cpu", (), 0, 64, 0.0, 0.0)
    ctx = zmq.Context()
    endpoint = f"ipc://{tmp_path}/w0"
    thread = SocketThread(ctx, endpoint, lambda peer, msg: None, lambda peer, msg: None,
                          lambda ping, peer: beat, lambda peer, msg: None, worker=3)
    thread.start()
    assert thread.bound.wait(5)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart(wire.encode(Ping(0.0, 0, 0)))
    assert dealer.poll(5000) and isinstance(wire.decode(dealer.recv_multipart()), Heartbeat)
    return ctx, thread, dealer


def test_a_stopping_worker_says_so_last_and_waits_until_it_is_read(tmp_path, monkeypatch):
    """ZeroMQ drops what a frontend has not read from a connection that drops: a worker that
    answered and exited at once lost a device error's 500 (answered 503 by the frontend). Its
    last message (Closing) follows every answer, and it holds the connection until the frontend
    says it read it."""
    ctx, thread, dealer = _serving(tmp_path, monkeypatch)
    try:
        replies = ctx.socket(zmq.PUSH)
        replies.connect(sockets_module.REPLIES)
        answer = Error(5, ErrorCode.INTERNAL, "forward failed")
        peer = thread._peers[0]
        replies.send_multipart([peer, *wire.encode(answer)])
        thread.stop()
        assert dealer.poll(5000)
        assert wire.decode(dealer.recv_multipart()) == answer
        assert dealer.poll(5000)
        assert wire.decode(dealer.recv_multipart()) == Closing(3, os.getpid())
        time.sleep(0.3)
        assert thread.is_alive()  # waits for the frontend
        started = time.monotonic()
        dealer.send_multipart(wire.encode(ClosingSeen(0)))
        thread.join(5)
        assert not thread.is_alive() and time.monotonic() - started < 1
    finally:
        thread.stop()
        thread.join(10)
        replies.close(linger=0)
        dealer.close(linger=0)
        ctx.term()


def test_the_wait_for_a_frontend_is_bounded_and_a_gone_one_is_not_waited_for(
        tmp_path, monkeypatch, caplog):
    ctx, thread, dealer = _serving(tmp_path, monkeypatch, farewell_s=0.5)
    try:
        # A worker that failed unforeseen says its requests may have run (answered=False);
        # the frontend never answers: the worker goes after FAREWELL_S.
        thread.stop(answered=False)
        started = time.monotonic()
        thread.join(5)
        assert not thread.is_alive() and 0.4 < time.monotonic() - started < 2
        assert dealer.poll(1000)
        assert wire.decode(dealer.recv_multipart()) == Closing(3, os.getpid(), False)
        assert any(r.message == "worker.farewell_unread" for r in caplog.records)
    finally:
        dealer.close(linger=0)
        ctx.term()
    (tmp_path / "gone").mkdir()
    ctx, thread, dealer = _serving(tmp_path / "gone", monkeypatch, farewell_s=5.0)
    try:
        dealer.close(linger=0)  # the frontend is gone (it pinged, then went)
        time.sleep(0.3)
        started = time.monotonic()
        thread.stop()
        thread.join(10)
        assert not thread.is_alive() and time.monotonic() - started < 1
    finally:
        ctx.term()
