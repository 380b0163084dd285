"""The worker's socket thread: who hears a worker's news."""

import zmq

from gpu_workers.sockets import SocketThread
from shmserve.protocol import Heartbeat, Ping, Submit


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
