"""Admission by deadline: a request that would not finish before its deadline, or that would make
requests already admitted miss theirs, is refused at once (429 with Retry-After) instead of
queued, computed late and answered 504.

Without it, a burst larger than a worker can serve within the deadline (600 requests of 32 texts
against a CPU worker doing ~70 texts/s, found in an outside check) is admitted up to the
queue's size, and since a pass mixes texts of many requests (length grouping), almost none of
them finishes in time: 240 of 600 answered 504 after 30 s, 16 answered 200, and 87% of the
texts computed went to requests that had already failed.

The estimate: the tokens admitted and not yet computed at a priority or above (a higher
priority runs first), plus the new request's, over the speed at which the worker drains a
backlog, plus one pass (the one running, and the granularity a request finishes at). The speed
is all the tokens over all the time of recent passes that left texts waiting (a lone small pass
runs far below the worker's speed, and judged by one, a large request after a quiet spell would
be refused; a mean of per-pass rates follows the last few passes' lengths), one speed per
worker, whichever model a pass ran.

Because a pass mixes texts of many requests, the requests admitted during a burst finish
together, when the backlog drains, not one after the other. So a new request is checked
against its own deadline and against the earliest deadline of every request it would delay (its
priority and below): admitted only when the estimate is within `SHARE` of the time left to each.
A request with nothing queued ahead of it at its priority or above is always admitted (a refusal
cannot make it faster), and until the worker has drained a backlog there is no estimate:
everything the queue bound lets in is admitted.

Measured (2 cores, AMD EPYC, fp32, the default config, after a warm-up of 20 x 32 texts;
2026-12-01 ~09:13; /v1/embeddings, corpus texts, all requests at once):

| burst | this rule (SHARE 0.75): 200 / 504 / 429 | without it: 200 / 504 / 429 |
|---|---|---|
| 600 x 32 texts, 30 s deadline | 122 / 0 / 478 (429s within 2.8 s) | 17 / 239 / 344 |
| 600 x 16-32 texts, 10 s | 60 / 0 / 540 | 2 / 338 / 260 |
| 300 x 16-32 texts, 5 s | 25 / 0 / 275 | 1 / 299 / 0 |

SHARE 0.9 admitted more at 30 s (136-157 x 200, none 504) but at 10 s and 5 s answered 56 and 17
x 504 against 7 and 3 x 200: the burst's own arrival (parsing and tokenizing hundreds of
requests) takes CPU from the workers for its first seconds, a fixed error that a short deadline
cannot absorb; 0.8: 129 / 0, 63 / 0, 21 / 4 x 504; 0.7: 82 / 0, 39 / 0, 24 / 0. An outside check
of the first version (own deadline only, a mean of per-pass rates) found 22-35 x 504 against
8-39 x 200 at 5-10 s deadlines. When another job takes the cores in the middle of a burst, no
estimate of a recent speed holds: admitted requests can still miss their deadlines then.
"""

from __future__ import annotations

import heapq
import threading

SHARE = 0.75  # of the time left before a deadline that the estimated wait may take
DECAY = 0.8  # per measured pass: the weight of older passes in the speed and pass time


class Backlog:
    """Requests admitted and not yet finished (their tokens not yet computed and their
    deadlines, by priority), and the speed the worker drains them at. The socket thread admits,
    the model thread drains and finishes: every update holds the lock."""

    def __init__(self, share: float = SHARE, decay: float = DECAY) -> None:
        self._lock = threading.Lock()
        self._share = share
        self._decay = decay
        self._tokens: dict[int, int] = {}
        self._deadlines: dict[int, list[tuple[float, int]]] = {}  # heaps, stale entries left in
        self._admitted: dict[int, float] = {}  # ticket -> deadline, while admitted
        self._ticket = 0
        self._work = 0.0  # decayed sums over backlogged passes: tokens, and their seconds
        self._time = 0.0
        self._passes = 0.0  # decayed count of those passes
        self.rate = 0.0  # tokens per second draining a backlog; 0: none measured yet
        self.pass_s = 0.0  # seconds a backlogged pass takes

    def refusal(self, priority: int, tokens: int, now: float, deadline: float) -> str | None:
        """Why admitting a request of `tokens` at `priority` with `deadline` (time.time()) would
        make it or a request it delays late; None: admit it."""
        if self.rate <= 0.0:
            return None
        with self._lock:
            ahead = sum(n for p, n in self._tokens.items() if p >= priority)
            if ahead <= 0:
                return None
            finish = (ahead + tokens) / self.rate + self.pass_s
            if finish > self._share * (deadline - now):
                return (f"the worker's queue needs ~{finish:.1f} s for this request at its "
                        f"recent speed, too close to its deadline in "
                        f"{max(deadline - now, 0.0):.1f} s")
            for level in sorted((p for p in self._tokens if p <= priority), reverse=True):
                earliest = self._earliest(level, now)
                if earliest is None:
                    continue
                queued = sum(n for p, n in self._tokens.items() if p >= level)
                finish = (queued + tokens) / self.rate + self.pass_s
                if finish > self._share * (earliest - now):
                    return (f"the worker's queue is full for the deadlines of the requests it "
                            f"holds: one is due in {max(earliest - now, 0.0):.1f} s, and with "
                            f"this request the queue needs ~{finish:.1f} s")
        return None

    def _earliest(self, level: int, now: float) -> float | None:
        """The earliest deadline still ahead among the requests admitted at `level` (one already
        past cannot be saved: it binds no one)."""
        heap = self._deadlines.get(level)
        while heap:
            deadline, ticket = heap[0]
            if ticket in self._admitted and deadline > now:
                return deadline
            heapq.heappop(heap)  # answered, or late anyway
        return None

    def add(self, priority: int, tokens: int, deadline: float) -> int:
        """Admit a request; its ticket, for `finished`."""
        with self._lock:
            self._ticket += 1
            self._tokens[priority] = self._tokens.get(priority, 0) + tokens
            self._admitted[self._ticket] = deadline
            heapq.heappush(self._deadlines.setdefault(priority, []), (deadline, self._ticket))
            return self._ticket

    def done(self, priority: int, tokens: int) -> None:
        """`tokens` of `priority` computed, or dropped with their request."""
        if tokens:
            with self._lock:
                self._tokens[priority] = self._tokens.get(priority, 0) - tokens

    def finished(self, ticket: int) -> None:
        """The request of `ticket` was answered: its deadline binds no one any more."""
        with self._lock:
            self._admitted.pop(ticket, None)

    def queued(self) -> int:
        with self._lock:
            return sum(self._tokens.values())

    def passed(self, tokens: int, seconds: float) -> None:
        """A forward pass that left texts queued computed `tokens` real tokens in `seconds`."""
        if tokens <= 0 or seconds <= 0.0:
            return
        d = self._decay
        self._work = self._work * d + tokens
        self._time = self._time * d + seconds
        self._passes = self._passes * d + 1.0
        self.rate = self._work / self._time
        self.pass_s = self._time / self._passes
