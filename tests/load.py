"""Closed-loop clients for tests that break things under load: each client thread posts a request
once its last one is answered (and `pace_s` has passed), and records every outcome, until the
load stops."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from typing import Any

from tests.stack import Stack

# Each client's pause after an answer. Without one, the clients kept both of CI's cores busy
# with requests alone (6 of them ~450 a second), and the tests beside them on the other xdist
# process slowed as much: 0.02 s takes a third of the CPU off a chaos file, a rolling restart
# and an apply under load (the clients still post ~40 a second each).
PACE_S = 0.02


class Load:
    """Subclasses say what to send (`body`) and what to record (`outcome`, `failure`)."""

    def __init__(self, stack: Stack, clients: int, pace_s: float = PACE_S) -> None:
        self.stack = stack
        self.pace_s = pace_s
        self.outcomes: list[Any] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def body(self, client: int, n: int) -> bytes:
        raise NotImplementedError

    def outcome(self, resp, started: float) -> Any:
        """What to record of an answered request (`started`: time.monotonic() before it)."""
        return str(resp.status)

    def failure(self, status: str, started: float) -> Any:
        """What to record of an HTTP error status or "conn:<error>"."""
        return status

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        assert not any(t.is_alive() for t in self._threads), "a client hung"

    def _run(self, client: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            started = time.monotonic()
            req = urllib.request.Request(self.stack.url + "/predict", data=self.body(client, n),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    outcome = self.outcome(resp, started)
            except urllib.error.HTTPError as exc:
                exc.close()
                outcome = self.failure(str(exc.code), started)
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                outcome = self.failure(f"conn:{type(getattr(exc, 'reason', exc)).__name__}",
                                       started)
            with self._lock:
                self.outcomes.append(outcome)
            self._stop.wait(self.pace_s)

    def mark(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def since(self, mark: int) -> Counter:
        with self._lock:
            return Counter(self.outcomes[mark:])

    def wait_for(self, count: int) -> None:
        target = self.mark() + count
        self.stack.wait_until(lambda: self.mark() >= target, 60, f"{count} more requests")
