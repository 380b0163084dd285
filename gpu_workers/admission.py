"""Admission by deadline: a request that the work queued ahead of it cannot finish before its
deadline is refused at once (429 with Retry-After) instead of queued, computed late and answered
504.

Without it, a burst larger than a worker can serve within the deadline (600 requests of 32 texts
against a CPU worker doing ~70 texts/s, found in an outside check) is admitted up to the
queue's size, and since a pass mixes texts of many requests (length grouping), almost none of
them finishes in time: 240 of 600 answered 504 after 30 s, 16 answered 200, and 87% of the
texts computed went to requests that had already failed.

The estimate is the tokens admitted and not yet computed, at this request's priority or above
(a higher priority runs first), plus its own, over the tokens per second at which the worker
drains a backlog: measured on passes that left texts waiting (a full pass; a lone small pass
runs far below the worker's speed, and judged by one, a large request after a quiet spell would
be refused), one speed per worker, whichever model a pass ran. A request is admitted when that
estimate is within `SHARE` of the time to its deadline: the estimate is of a recent speed, and
the batcher does not run the queue strictly in order, so a request admitted right at its
deadline would often miss it. A request with nothing queued ahead of it is always admitted (a
refusal cannot make it faster), and until the worker has drained a backlog there is no
estimate: everything the queue bound lets in is admitted.

Measured (2 cores, AMD EPYC, fp32, the default config, 600 simultaneous requests of 32 corpus
texts after a warm-up, 30 s deadline; 2026-12-01): 157 answered 200 (the last after 29.2 s),
none 504, and 443 answered 429 within 2.5 s. Without admission by deadline: 15 x 200, 241 x 504
and 344 x 429 (the queue bound). Earlier versions: the speed of every pass, small ones included,
and SHARE 1.0: 128 x 200, 10 x 504, 462 x 429; the same at SHARE 0.9: 120 x 200, none 504.
"""

from __future__ import annotations

import threading

SHARE = 0.9  # of the time left before a request's deadline that its estimated wait may take


class Backlog:
    """Tokens admitted and not yet computed, by priority, and the speed they drain at. The socket
    thread admits, the model thread drains: every update holds the lock."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[int, int] = {}
        self._smoothing = smoothing
        self.rate = 0.0  # tokens per second of a full pass, smoothed; 0: none measured yet

    def wait_s(self, priority: int, tokens: int) -> float:
        """Seconds to compute what is queued at `priority` or above, then `tokens` more, at the
        backlog speed; 0 when nothing is queued ahead or no backlog has been measured."""
        if self.rate <= 0.0:
            return 0.0
        with self._lock:
            ahead = sum(n for p, n in self._tokens.items() if p >= priority)
        return (ahead + tokens) / self.rate if ahead > 0 else 0.0

    def add(self, priority: int, tokens: int) -> None:
        with self._lock:
            self._tokens[priority] = self._tokens.get(priority, 0) + tokens

    def done(self, priority: int, tokens: int) -> None:
        """`tokens` of `priority` computed, or dropped (finished, failed, aborted)."""
        if tokens:
            with self._lock:
                self._tokens[priority] = self._tokens.get(priority, 0) - tokens

    def queued(self) -> int:
        with self._lock:
            return sum(self._tokens.values())

    def passed(self, tokens: int, seconds: float) -> None:
        """A forward pass that left texts queued computed `tokens` real tokens in `seconds`."""
        if tokens <= 0 or seconds <= 0.0:
            return
        sample = tokens / seconds
        self.rate = sample if self.rate <= 0.0 else (
            self.rate + self._smoothing * (sample - self.rate))
