"""Admission by deadline: a request that the work queued ahead of it would not let finish before
its deadline is refused at once (429 with Retry-After) instead of queued, computed late and
answered 504.

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

A request is admitted when that estimate is within `SHARE` of the time to its deadline. The
share was set when a pass mixed texts of the whole queue, so the requests admitted during a
burst finished together when the backlog drained and a small error in the estimate made them
all late together; the batcher now groups within a window of the oldest texts
(`batching.pass_window`), so they finish roughly in order and an error costs the last ones. The
share stays under 1 because the burst's own arrival (parsing and tokenizing hundreds of
requests) takes CPU from the workers for its first seconds. With a window of 4 batches, 0.9
against 0.75 (600 x 16-32 texts, 10 s, 2 rounds, 2026-12-01 ~11:20, a faster spell of the same
machine) answered 114-133 against 111-119 x 200 and no 504 either way, the slowest 200 at 10.0
s: within the noise, and at the edge, so 0.75 stays. A request with nothing queued ahead of it
at its priority or above is always admitted (a refusal cannot make it faster). Until the
worker has drained a backlog, its estimate is one full pass of 32-token texts timed at warm-up
(gpu_workers.model.warm_up), SEED_SLOWDOWN times slower, with the weight of one pass: without
it a fresh worker admitted
everything the queue bound let in, and the first burst after a start answered 10-126 x 504 of
300 (16-32 texts, 5 s; `scripts/burst.py --cold`, 4 rounds, 2026-12-01 ~12:10, AVX512-BF16
EPYC), against 0-16 with it; the rest of those 504s are the first passes' slowness (the burst's
parsing takes the cores, new pass shapes compile their kernels). Without any estimate (`rate`
0: a Backlog nobody seeded) everything is admitted.

The frontends apply the same rule before they tokenize a request (`heard_refusal`, for
frontend.pool.WorkerPool.behind), from each worker's last heartbeat (its speed, pass time and
queued tokens by priority) less what it has drained since: they count nothing sent since the
heartbeat, so they err towards admitting, and the worker decides what it is sent.

Measured (2 cores, AMD EPYC, fp32, the default config, after a warm-up of 20 x 32 texts;
2026-12-01 ~09:37; /v1/embeddings, corpus texts, all requests at once):

| burst | this rule (SHARE 0.75): 200 / 504 / 429 | without it: 200 / 504 / 429 |
|---|---|---|
| 600 x 32 texts, 30 s deadline | 129 / 0 / 471 (429s within 1.8 s) | 17 / 239 / 344 |
| 600 x 16-32 texts, 10 s | 56 / 0 / 544 | 2 / 338 / 260 |
| 300 x 16-32 texts, 5 s | 28 / 0 / 272 | 1 / 299 / 0 |

Other shares (with the deadline check below, which changed nothing in bursts): 0.9 admitted
more at 30 s (136-157 x 200, none 504) but at 10 s and 5 s answered 56 and 17
x 504 against 7 and 3 x 200; 0.8: 129 / 0, 63 / 0, 21 / 4 x 504; 0.7: 82 / 0, 39 / 0, 24 / 0.
Also checking the earliest deadline of the admitted requests a newcomer would delay changed
nothing in these bursts (their deadlines are alike) and refused 5 of 200 and 2 of 269 requests
under a sustainable Poisson load (110 and 140 texts/s of 1-64 texts, 5 s deadlines; none without
the rule), against 1 of 213 (and one 504) and 0 of 279 without that check: not kept. An
outside check of the first version (a mean of per-pass rates, share 0.9) found 22-35 x 504
against 8-39 x 200 at 5-10 s deadlines. When another job takes the cores in the middle of a
burst, no estimate of a recent speed holds: admitted requests can still miss their deadlines.
"""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Iterable

from shmserve.protocol import Heartbeat, Queued

SHARE = 0.75  # of the time left before a deadline that the estimated wait may take
DECAY = 0.8  # per measured pass: the weight of older passes in the speed and pass time
# A fresh worker's first estimate is its warm-up pass taken this much slower: the first burst
# it meets runs slower than warm-up (the burst's own parsing takes the cores, new pass shapes
# compile). Cold bursts of 300 x 16-32 texts at a 5 s deadline (2-core AVX512-BF16 EPYC,
# scripts/burst.py --cold, 4 interleaved rounds a pair, 2026-12-01 ~15:00): as timed, 53-64 x
# 200 and 16-19 x 504; 1.5, 46-54 x 200 and no 504 (the slowest 200 at 3.7 s); 2.0, 36-44 x
# 200 and no 504. Not measured on a GPU.
SEED_SLOWDOWN = 1.5
MAX_RETRY_AFTER_S = 60  # a client's own limit (OpenAI's SDK ignores a longer Retry-After)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is refused for its load, and the Retry-After its 429 carries."""

    why: str
    retry_after_s: int


def retry_after_s(wait: float, draw: float | None = None) -> int:
    """Seconds a refused client should wait before it sends again: `wait` (the estimated time
    until the work ahead has drained enough for the same request to be admitted, if nothing
    else arrives) times a random factor in [1, 2), so that a refused burst does not come back
    all at once when the backlog is estimated drained; at least 1, at most MAX_RETRY_AFTER_S.
    `draw` in [0, 1) replaces the random draw (tests)."""
    if not math.isfinite(wait):
        return MAX_RETRY_AFTER_S
    factor = 1.0 + (random.random() if draw is None else draw)
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(wait * factor)))


def ahead(queued: Iterable[tuple[int, int]], priority: int) -> int:
    """Tokens of (priority, tokens) pairs that run before a request at `priority`."""
    return sum(n for p, n in queued if p >= priority)


def finish_s(queued: float, tokens: int, rate: float, pass_s: float) -> float:
    """Seconds until a request of `tokens` behind `queued` tokens is computed, at `rate` tokens
    per second in passes of `pass_s`; 0.0 when nothing is ahead or no speed is known (always
    admitted)."""
    if rate <= 0.0 or queued <= 0:
        return 0.0
    return (queued + tokens) / rate + pass_s


def too_late(finish: float, now: float, deadline: float, share: float = SHARE) -> bool:
    """Whether a request `finish` seconds from `now` (finish_s: 0.0 for one always admitted)
    should be refused for its deadline."""
    return finish > 0.0 and finish > share * (deadline - now)


def refuse(finish: float, now: float, deadline: float, whose: str = "the worker's queue",
           share: float = SHARE, drained: float = math.inf) -> Refusal:
    """The refusal of a request `finish` seconds from done (too_late said so). It could be
    admitted once the work ahead has drained by the excess: the same request sent again that
    much later, with the same time to its deadline, is within `share` of it; or once all of
    it has (`drained` seconds: nothing ahead is always admitted). A request too large for its
    deadline alone was told 60 s where the queue ahead drained in 0.3 s (an outside check)."""
    left = max(deadline - now, 0.0)
    return Refusal(f"{whose} needs ~{finish:.1f} s for this request at its recent speed, too "
                   f"close to its deadline in {left:.1f} s",
                   retry_after_s(min(finish - share * left, drained)))


def heard_refusal(beats: Iterable[tuple[Heartbeat, float]], priority: int, tokens: int,
                  deadline: float) -> Refusal | None:
    """Why every worker heard from in `beats` (each ready worker's last heartbeat, and when it
    came, time.monotonic()) would refuse a request of `tokens` (0: not yet tokenized) at
    `priority` due at `deadline` (time.time()); None: send it (its worker decides). What a
    worker has queued ahead is its last heartbeat's, less what it has drained since at its
    speed: work sent since is not counted, so the estimate errs towards admitting. (Counting
    what a frontend has sent and not had answered made it refuse far more than the workers
    would: a frontend busy refusing reads its replies late, and those stay counted. With
    clients that retry a 429 at once, 40 of them x 64 texts at low priority against the
    default config, it answered 3,761-12,829 x 429 and 24-129 x 200 in 20 s, in 3 of 4 runs,
    where the workers' rule alone answered 0-268 x 429 and 130-140 x 200; from heartbeats
    alone, 0-296 x 429 and 135-144 x 200. A /tmp script, interleaved, 2026-12-01
    ~16:35-16:45, the AVX512-BF16 EPYC.)"""
    now, monotonic = time.time(), time.monotonic()
    soonest, drained = None, math.inf
    for beat, heard_at in beats:
        heard = ahead(((q.priority, q.tokens) for q in beat.queued_tokens), priority)
        queued = heard - beat.drain_rate * (monotonic - heard_at)
        finish = finish_s(queued, tokens, beat.drain_rate, beat.drain_pass_s)
        if not too_late(finish, now, deadline):
            return None
        soonest = finish if soonest is None else min(soonest, finish)
        drained = min(drained, queued / beat.drain_rate)  # (too late: rate > 0, queued > 0)
    if soonest is None:
        return None  # no ready worker: the dispatcher waits for one, or answers 503
    return refuse(soonest, now, deadline, "every worker's queue", drained=drained)


class Backlog:
    """Tokens admitted and not yet computed, by priority, and the speed the worker drains them
    at. The socket thread admits, the model thread drains: every update holds the lock."""

    def __init__(self, share: float = SHARE, decay: float = DECAY) -> None:
        self._lock = threading.Lock()
        self._share = share
        self._decay = decay
        self._tokens: dict[int, int] = {}
        self._work = 0.0  # decayed sums over backlogged passes: tokens, and their seconds
        self._time = 0.0
        self._passes = 0.0  # decayed count of those passes
        self.rate = 0.0  # tokens per second draining a backlog; 0: none measured yet
        self.pass_s = 0.0  # seconds a backlogged pass takes

    def refusal(self, priority: int, tokens: int, now: float, deadline: float
                ) -> Refusal | None:
        """Why a request of `tokens` at `priority` due at `deadline` (time.time()) would be
        late; None: admit it."""
        if self.rate <= 0.0:
            return None
        with self._lock:
            queued = ahead(self._tokens.items(), priority)
        finish = finish_s(queued, tokens, self.rate, self.pass_s)
        if not too_late(finish, now, deadline, self._share):
            return None
        return refuse(finish, now, deadline, share=self._share, drained=queued / self.rate)

    def retry_after_s(self, tokens: int) -> int:
        """Retry-After for a request refused because the queue is full: the time to drain
        `tokens` at the recent speed (1 s while no speed is known)."""
        return retry_after_s(tokens / self.rate if self.rate > 0.0 else 1.0)

    def queued_by_priority(self) -> tuple[Queued, ...]:
        """What the heartbeats tell the frontends (their early refusal, WorkerPool.behind)."""
        with self._lock:
            return tuple(Queued(p, n) for p, n in self._tokens.items() if n > 0)

    def add(self, priority: int, tokens: int) -> None:
        with self._lock:
            self._tokens[priority] = self._tokens.get(priority, 0) + tokens

    def done(self, priority: int, tokens: int) -> None:
        """`tokens` of `priority` computed, or dropped with their request."""
        if tokens:
            with self._lock:
                self._tokens[priority] = self._tokens.get(priority, 0) - tokens

    def queued(self) -> int:
        with self._lock:
            return sum(self._tokens.values())

    def seed(self, tokens: int, seconds: float) -> None:
        """The first estimate, before any backlog drained: a warm-up pass of `tokens` in
        `seconds`, taken SEED_SLOWDOWN times slower, with the weight of one pass."""
        self.passed(tokens, seconds * SEED_SLOWDOWN)

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
