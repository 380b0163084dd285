"""What nginx answers itself, in GET /metrics: the requests that got no frontend's response (a
rate limit's 429, a body over the limit's 413, 502 when no frontend answered, 499 when the
client left before its answer, a CORS preflight's 204, ...), which no frontend counts.

nginx writes each such request's status as a syslog datagram to a unix socket in the run
directory (nginx/nginx.conf: ``access_log syslog:server=unix:... if=...``); the reaper, one per
deployment, receives them on a thread and counts them in the metrics directory, where every
frontend's scrape reads them. Datagrams are fire-and-forget for nginx (its socket is
non-blocking): while no reaper listens (its own restart) nginx logs a failed connect and the
status goes uncounted, and a burst past the socket's buffer is dropped, not waited for.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from pathlib import Path

from prometheus_client import Counter


log = logging.getLogger("shmserve.nginx_stats")

RESPONSES = Counter("shmserve_nginx_responses", "Responses nginx made itself, with no "
                    "frontend's answer behind them, by status", ["status"])
# Created at zero when the receiver starts, so an alert on increase() sees the first one.
KNOWN = ("400", "408", "413", "429", "431", "499", "502", "504")
RECEIVE_BUFFER = 1 << 20  # bytes: a burst of ~10,000 datagrams waits here for the thread
BATCH = 1024  # datagrams tallied per write to the metrics directory at most


def status_of(datagram: bytes) -> str | None:
    """The status in nginx's syslog line (``<190>Dec  2 10:22:48 shmserve: 429``), or None."""
    _, colon, message = datagram.rpartition(b": ")
    status = message.strip()
    if not colon or len(status) != 3 or not status.isdigit():
        return None
    return status.decode()


class Receiver:
    """Binds `path` (a stale file from a previous reaper is replaced) and counts what arrives."""

    def __init__(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        self.sock.bind(str(path))
        self.path = path
        self.children = {status: RESPONSES.labels(status) for status in KNOWN}
        self.unreadable = 0

    def receive(self, block: bool = True) -> int:
        """Count one datagram (waiting for it when `block`) and what else is already there,
        up to BATCH; the number of datagrams read."""
        tally: collections.Counter[str] = collections.Counter()
        read = 0
        flags = 0 if block else socket.MSG_DONTWAIT
        while read < BATCH:
            try:
                datagram = self.sock.recv(512, flags)
            except BlockingIOError:
                break
            read += 1
            flags = socket.MSG_DONTWAIT
            status = status_of(datagram)
            if status is None:
                self.unreadable += 1
                if self.unreadable == 1:  # once: a format changed, not per datagram
                    log.warning("nginx_stats.unreadable", extra={"fields": {
                        "datagram": datagram[:80].decode("utf-8", "replace")}})
            else:
                tally[status] += 1
        for status, count in tally.items():
            child = self.children.get(status)
            if child is None:
                child = self.children[status] = RESPONSES.labels(status)
            child.inc(count)
        return read

    def serve_forever(self) -> None:
        while True:
            try:
                self.receive()
            except OSError:
                if self.sock.fileno() == -1:  # closed: stop
                    return
                log.exception("nginx_stats.failed")
                time.sleep(1.0)  # a lasting error logs once a second, not in a loop

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="nginx-stats", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)
