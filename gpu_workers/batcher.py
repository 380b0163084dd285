"""Batch formation: a pure function from queued texts and limits to the next batch.

No model, no sockets, no clock of its own: the worker passes `now` in, so every rule here is
unit-tested directly.

Rules:
  * The anchor is always in the next batch. Normally it is the oldest text of the highest
    priority present; on a fair turn (the worker's pass after N - 1 in a row that went before
    an older text, `FairTurns`; N being `batching.fair_share_every`) it is the oldest text of
    all. So higher priorities go first, and lower ones still get at least one batch in N while
    higher ones saturate the worker: nothing starves, and a higher-priority text waits at most
    for the running batch and one fair-turn batch.
    (Every Nth pass whatever went before, a query that came at one beside a flood of one
    priority waited a second pass for nothing.)
  * Only texts of the anchor's model join it, and only from the pass's window: the oldest
    `window` texts of that model in the order the anchors are taken (highest priority first,
    then arrival; on a fair turn arrival alone). So under a backlog a pass takes the texts of the
    oldest few requests and requests finish roughly in order; grouping across the whole queue
    instead mixes every request into every pass, and a backlog then finishes them all together,
    late. A queue shorter than the window is grouped as a whole.
  * Among those, texts are taken in order of closeness in length to the batch, so the batch holds
    similar lengths: padded tokens (texts x longest) stay under `max_batch_tokens`, the count under
    `max_batch_size`, and padded / real tokens under `max_pad_ratio` (the length bucketing).
  * A model that runs several length groups in one pass (gpu_workers.packed) gets them merged
    (`form_pass`): after the first batch, further batches of the same model join the pass while
    its texts fit `max_batch_size` and its padded tokens `max_batch_tokens`; on a turn that is
    not fair, the batches of the top priority first (grown among those texts alone), then the
    lower ones, so a request of the top priority runs in as few passes as its texts fit; the
    lower ones add at most `top_up` times the top priority's padded tokens, so its pass takes
    at most about twice its own work, not a full pass (a query beside a bulk flood on a CPU:
    ~20 ms, not ~300).
  * The batch waits for company at most `max_wait_ms` after its oldest text arrived, and not at all
    once a full batch is queued, nor where none is expected: while requests have been arriving
    further apart than `max_wait_ms` (`Arrivals`), a lone request waited out the whole of it for
    nothing (Triton's dynamic batcher and text-embeddings-inference do not wait at all).
"""

from __future__ import annotations

import bisect
import operator
from itertools import compress
from dataclasses import dataclass, replace
from typing import Callable, Generic, Protocol, Sequence, TypeVar


class Text(Protocol):
    @property
    def model(self) -> str: ...
    @property
    def length(self) -> int: ...
    @property
    def priority(self) -> int: ...
    @property
    def arrived(self) -> float: ...


T = TypeVar("T", bound=Text)
_length = operator.attrgetter("length")
_priority = operator.attrgetter("priority")
_model = operator.attrgetter("model")


@dataclass(frozen=True, slots=True)
class Limits:
    max_batch_size: int
    max_batch_tokens: int
    max_wait_s: float
    max_pad_ratio: float = 1.5
    window: int = 0  # texts a pass chooses from; 0: the whole queue
    top_up: float = 1.0  # lower-priority padded tokens a pass may add, per top-priority one

    @classmethod
    def of(cls, batching) -> "Limits":
        """From the config's `batching` section (shmserve.config.BatchingConfig)."""
        return cls(batching.max_batch_size, batching.max_batch_tokens,
                   batching.max_wait_ms / 1000.0, batching.max_pad_ratio,
                   batching.pass_window * batching.max_batch_size, batching.top_up_ratio)


@dataclass(frozen=True, slots=True)
class Batch(Generic[T]):
    texts: list[T]  # sorted by length
    padded_len: int

    @property
    def real_tokens(self) -> int:
        return sum(t.length for t in self.texts)

    @property
    def padded_tokens(self) -> int:
        return self.padded_len * len(self.texts)


def anchor_index(queue: Sequence[Text], fair_turn: bool = False) -> int:
    """The queue is in arrival order: its first text is the oldest."""
    if fair_turn:
        return 0
    top = max(map(_priority, queue))
    for i, text in enumerate(queue):  # the oldest of the highest priority
        if text.priority == top:
            return i
    raise AssertionError("unreachable: the queue holds a text of its highest priority")


class FairTurns:
    """Which passes are fair turns: the pass after `every` - 1 in a row that left the oldest
    text queued (a higher priority went before it); `every` 1: every pass. Counted from each
    pass's rest, so the batch loop scans no queue for it."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._left = 0  # passes in a row that left the oldest text queued

    def next(self) -> bool:
        """Whether the next pass is a fair turn."""
        return self._left >= self.every - 1

    def ran(self, oldest: Text, rest: Sequence[Text]) -> None:
        """A pass ran from a queue whose oldest text was `oldest`, leaving `rest` (arrival
        order): the oldest is its first text if the pass left it."""
        self._left = self._left + 1 if rest and rest[0] is oldest else 0


class Arrivals:
    """The recent time between requests' arrivals at a worker (any model's): a weighted mean
    of the gaps, each counted as at most GAP_CAP x max_wait, so that after an idle minute a
    burst's requests wait for each other again from its eighth or so. A request that arrives
    while the worker has nothing admitted and unanswered (`alone`) counts as that longest gap:
    it came after the last one was answered, as a serial client's next request does, so no
    wait would have brought it sooner (a serial client whose round trip is under max_wait
    waited out the whole wait on every other request: an outside check, 135 of 345 at 50 ms)."""

    WEIGHT = 0.2  # of the newest gap
    GAP_CAP = 4

    def __init__(self, max_wait_s: float) -> None:
        self.cap = self.GAP_CAP * max_wait_s
        self.gap_s = self.cap  # none seen yet: no company expected
        self._last: float | None = None

    def arrived(self, at: float, alone: bool = False) -> None:
        if self._last is not None:
            gap = self.cap if alone else min(max(0.0, at - self._last), self.cap)
            self.gap_s += self.WEIGHT * (gap - self.gap_s)
        self._last = at


def wait_time(queue: Sequence[Text], now: float, limits: Limits, gap_s: float = 0.0) -> float:
    """Seconds to wait before forming a batch; 0 means form it now. The queue is not empty,
    and in arrival order; `gap_s`: the recent time between arrivals (Arrivals.gap_s)."""
    if gap_s >= limits.max_wait_s:  # no company expected within the wait
        return 0.0
    if len(queue) >= limits.max_batch_size:
        return 0.0
    if sum(t.length for t in queue) >= limits.max_batch_tokens:
        return 0.0
    return max(0.0, queue[0].arrived + limits.max_wait_s - now)


def form_batch(queue: Sequence[T], limits: Limits,
               fair_turn: bool = False) -> tuple[Batch[T], list[T]]:
    """Split a non-empty queue (arrival order) into the next batch and the rest (arrival order):
    a pass that merges nothing."""
    (batch,), rest = form_pass(queue, limits, fair_turn)
    return batch, rest


def form_pass(queue: Sequence[T], limits: Limits, fair_turn: bool = False,
              merges: Callable[[T], bool] = lambda text: False
              ) -> tuple[list[Batch[T]], list[T]]:
    """The next forward pass: its batches (length groups), and the rest of the queue (arrival
    order). One batch, unless `merges` says the first batch's model runs groups in one pass:
    then also the batches `form_batch` would form next, while they are of that model and the
    pass stays within the limits; and on a turn that is not fair, first every batch of the
    anchor's priority that fits (each grown among those texts alone), then lower ones. Grown
    among all, the first batch would fill the pass with lower-priority texts near the anchor's
    length, and a request of the top priority whose texts differ in length would run one text
    a pass between them (an outside check: 4-text high-priority requests under a low flood took
    2-4 passes, and some missed a 2 s deadline)."""
    anchor = queue[anchor_index(queue, fair_turn)]
    if fair_turn or not merges(anchor):
        return _merged(queue, limits, fair_turn, merges)
    top = list(compress(queue, map(anchor.priority.__eq__, map(_priority, queue))))
    if len(top) == len(queue):
        return _merged(queue, limits, False, merges)
    batches, _ = _merged(top, limits, False, merges)
    rest = _without(queue, {id(t) for batch in batches for t in batch.texts})
    # The rest of the pass, grown within the room the top priority left, and to at most
    # `top_up` times its padded tokens: the top priority's pass is not a full one
    padded = sum(b.padded_tokens for b in batches)
    room = replace(
        limits, max_batch_size=limits.max_batch_size - sum(len(b.texts) for b in batches),
        max_batch_tokens=min(limits.max_batch_tokens - padded, int(limits.top_up * padded)))
    if not rest or room.max_batch_size <= 0 or room.max_batch_tokens <= 0:
        return batches, rest
    more, rest = _merged(rest, room, False, merges, anchor.model, strict=True)
    return batches + more, rest


def _merged(queue: Sequence[T], limits: Limits, fair_turn: bool, merges: Callable[[T], bool],
            model: str | None = None, strict: bool = False) -> tuple[list[Batch[T]], list[T]]:
    """The batches form_batch would form one after another from `queue` (the first anchored
    by `fair_turn`), while their model merges groups, is `model` (when given) and they fit the
    limits (`strict`: the first too; else it is taken whatever it holds); and the rest."""
    anchor = queue[anchor_index(queue, fair_turn)]
    if model is not None and anchor.model != model:
        return [], list(queue)
    model = anchor.model
    # The model's texts sorted once for the whole pass: each merged batch is what form_batch
    # on the rest would form, as the rest's sorted texts are these less the ones taken (the
    # sort is stable).
    same, cut = _same_model_by_length(queue, model, limits.window, fair_turn)
    window = {id(t) for t in same} if cut else None  # None: every text of the model is in it
    lengths = list(map(_length, same))
    batches: list[Batch[T]] = []
    taken: set[int] = set()  # ids: texts are told apart by identity, not equality
    rest: list[T] = list(queue)
    texts = padded = 0
    while True:
        lo, hi = _grow(same, lengths, anchor, limits)
        batch = Batch(same[lo:hi + 1], lengths[hi])
        if (batches or strict) and (texts + len(batch.texts) > limits.max_batch_size
                                    or padded + batch.padded_tokens > limits.max_batch_tokens):
            break
        batches.append(batch)
        taken.update(map(id, batch.texts))
        rest = _without(queue, taken)
        texts, padded = texts + len(batch.texts), padded + batch.padded_tokens
        if not rest or not merges(batch.texts[0]):
            break
        anchor = rest[anchor_index(rest)]
        if anchor.model != model or (window is not None and id(anchor) not in window):
            break
        del same[lo:hi + 1], lengths[lo:hi + 1]
    return batches, rest


# map and compress keep the per-text work in C: a GPU worker's queue holds thousands of texts,
# and a pass is formed from it every few milliseconds.
def _same_model_by_length(queue: Sequence[T], model: str, window: int = 0,
                          fair_turn: bool = False) -> tuple[list[T], bool]:
    """The model's texts in the pass's window, sorted by length, and whether the window left
    some of them out."""
    same = list(compress(queue, map(model.__eq__, map(_model, queue))))
    cut = bool(window) and len(same) > window
    if cut:
        if not fair_turn:  # highest priority first; the sort is stable, so arrival next
            same.sort(key=_priority, reverse=True)
        del same[window:]
    same.sort(key=_length)
    return same, cut


def _without(queue: Sequence[T], ids: set[int]) -> list[T]:
    """The texts of `queue` whose ids are not in `ids`, in order."""
    return list(compress(queue, map(operator.not_, map(ids.__contains__, map(id, queue)))))


def _grow(same: list[T], lengths: list[int], anchor: T, limits: Limits) -> tuple[int, int]:
    """The batch around `anchor` in `same` (sorted by length; `lengths` theirs): same[lo:hi+1].
    Texts join in order of the padding they add while the limits hold."""
    # Position of the anchor itself among equal lengths (identity, not equality).
    pos = bisect.bisect_left(lengths, anchor.length)
    while same[pos] is not anchor:
        pos += 1
    lo, hi = pos, pos
    longest, real = anchor.length, max(anchor.length, 1)
    last, size = len(same) - 1, limits.max_batch_size
    budget, ratio = limits.max_batch_tokens, limits.max_pad_ratio
    while hi - lo + 1 < size:
        count = hi - lo + 2
        # The text that adds the least padding goes first (the shorter on a tie): a shorter
        # text pads itself up to the longest, a longer one pads every text already in.
        down = longest - lengths[lo - 1] if lo > 0 else None
        up = (lengths[hi + 1] - longest) * (count - 1) if hi < last else None
        sides = ((-1, 1) if up is None or (down is not None and down <= up) else (1, -1))
        for side in sides:
            if (down if side < 0 else up) is None:
                continue
            length = lengths[lo - 1] if side < 0 else lengths[hi + 1]
            new_len = longest if side < 0 else length
            new_real = real + max(length, 1)
            padded = new_len * count
            if padded <= budget and padded <= ratio * new_real:
                lo, hi = (lo - 1, hi) if side < 0 else (lo, hi + 1)
                longest, real = new_len, new_real
                break
        else:
            break
    return lo, hi
