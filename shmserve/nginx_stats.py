"""What nginx answers itself, in GET /metrics: the requests that got no frontend's response (a
rate limit's 429, a body over the limit's 413, 502 when no frontend answered, 499 when the
client left before its answer, a CORS preflight's 204, ...), which no frontend counts.

nginx appends each such request's status as a line to a file in the run directory
(nginx/nginx.conf: ``access_log ... if=...``); the reaper, one per deployment, reads what was
added every half second on a thread and counts it in the metrics directory, where every
frontend's scrape reads it. A file, not datagrams: nginx's syslog datagrams to a unix socket
were dropped past the socket's queue (``net.unix.max_dgram_qlen``, 10 by default) whenever the
reader was not scheduled at once, a third of a flood of 429s (an outside check). The reaper
keeps its offset in a file beside it, so a restarted reaper counts from where the last one
stopped; past ROTATE_BYTES it empties the file (nginx appends with O_APPEND, so its next line
goes to the start), which can lose a line written in the microseconds between the last read
and the truncation.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import threading
from pathlib import Path

from prometheus_client import Counter

from shmserve.files import write_private

log = logging.getLogger("shmserve.nginx_stats")

RESPONSES = Counter("shmserve_nginx_responses", "Responses nginx made itself, with no "
                    "frontend's answer behind them, by status", ["status"])
INCOMPLETE = Counter("shmserve_nginx_incomplete_responses", "Frontends' answers nginx did "
                     "not pass on whole (the client gone or too slow mid-answer, or nginx "
                     "unable to buffer it), by status", ["status"])
# Created at zero when the reader starts, so an alert on increase() sees the first one.
KNOWN = ("400", "408", "413", "414", "415", "429", "431", "499", "502", "504")
ROTATE_BYTES = 1 << 20  # ~260,000 answers ("429\n")
POLL_S = 0.5
# Pages held for nginx's next lines (reserve): a full run directory lost them, the very cut
# answers it made among them (an outside check)
RESERVED_BYTES = 2 * ROTATE_BYTES
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
FALLOC_FL_KEEP_SIZE = 1


def reserve(fd: int, size: int = RESERVED_BYTES) -> bool:
    """Allocate the file's pages up to `size`, past its end, without changing its size
    (fallocate with KEEP_SIZE): nginx's appends (O_APPEND, at the end) then need no page a full
    filesystem cannot give. False where the filesystem refuses (full, or no fallocate)."""
    return _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, size) == 0


class Reader:
    """Counts the lines nginx added to `path` since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset_path = path.with_name(path.name + ".offset")
        self.children = {status: RESPONSES.labels(status) for status in KNOWN}
        self.cut = {"200": INCOMPLETE.labels("200")}  # "cut STATUS" lines (nginx.conf)
        self.unreadable = 0
        self.offset = self._saved_offset()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the thread's polls and the last one at stop

    def _saved_offset(self) -> int:
        """Where the last reader stopped; without a record, the file's end (what is there was
        counted by an earlier deployment, or cannot be told apart from it)."""
        size = self._size()
        try:
            saved = int(self.offset_path.read_text())
        except (OSError, ValueError):
            return size
        return saved if 0 <= saved <= size else size

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def poll(self) -> int:
        """Count the whole lines added since the last poll, empty the file once it is past
        ROTATE_BYTES; the number of lines counted."""
        with self._lock:
            return self._poll()

    def _poll(self) -> int:
        try:
            with self.path.open("r+b") as file:
                counted = self._count(file)
                if self.offset >= ROTATE_BYTES:
                    counted += self._count(file)  # what came meanwhile, then empty it
                    file.truncate(0)
                    self.offset = 0
                reserve(file.fileno())  # again after a truncation, which let the pages go
        except FileNotFoundError:
            return 0  # nginx creates it when it starts
        if counted:
            self._save()
        return counted

    def _count(self, file) -> int:
        size = os.fstat(file.fileno()).st_size
        if size < self.offset:  # emptied by someone else: start again
            self.offset = 0
        file.seek(self.offset)
        data = file.read(size - self.offset)
        whole = data[:data.rfind(b"\n") + 1]  # a line still being written waits
        self.offset += len(whole)
        tally: collections.Counter[str] = collections.Counter()
        cut: collections.Counter[str] = collections.Counter()
        for line in whole.splitlines():
            status = line.strip().decode("ascii", "replace")
            if len(status) == 3 and status.isdigit():
                tally[status] += 1
            elif status.startswith("cut ") and len(status) == 7 and status[4:].isdigit():
                cut[status[4:]] += 1
            else:
                self.unreadable += 1
                if self.unreadable == 1:  # once: a format changed, not per line
                    log.warning("nginx_stats.unreadable", extra={"fields": {
                        "line": status[:80]}})
        for counts, children, counter in ((tally, self.children, RESPONSES),
                                          (cut, self.cut, INCOMPLETE)):
            for status, count in counts.items():
                child = children.get(status)
                if child is None:
                    child = children[status] = counter.labels(status)
                child.inc(count)
        return sum(tally.values()) + sum(cut.values())

    def _save(self) -> None:
        write_private(self.offset_path, str(self.offset))

    def serve_forever(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.poll()
            except OSError:
                log.exception("nginx_stats.failed")

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="nginx-stats", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()
        self.poll()  # what nginx wrote last
