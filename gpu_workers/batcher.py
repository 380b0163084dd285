"""Batch formation: a pure function from queued texts and limits to the next batch.

No model, no sockets, no clock of its own: the worker passes `now` in, so every rule here is
unit-tested directly.

Rules:
  * The anchor is always in the next batch. Normally it is the oldest text of the highest
    priority present; on a fair turn (the worker makes every Nth batch one, N being
    `batching.fair_share_every`) it is the oldest text of all. So higher priorities go first,
    and lower ones still get at least one batch in N while higher ones saturate the worker:
    nothing starves, and a higher-priority text waits at most for the running batch and one
    fair-turn batch.
  * Only texts of the anchor's model join it.
  * Among those, texts are taken in order of closeness in length to the batch, so the batch holds
    similar lengths: padded tokens (texts x longest) stay under `max_batch_tokens`, the count under
    `max_batch_size`, and padded / real tokens under `max_pad_ratio` (the length bucketing).
  * A model that runs several length groups in one pass (gpu_workers.packed) gets them merged
    (`form_pass`): after the first batch, further batches of the same model join the pass while
    its texts fit `max_batch_size` and its padded tokens `max_batch_tokens`.
  * The batch waits for company at most `max_wait_ms` after its oldest text arrived, and not at all
    once a full batch is queued.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class Limits:
    max_batch_size: int
    max_batch_tokens: int
    max_wait_s: float
    max_pad_ratio: float = 1.5

    @classmethod
    def of(cls, batching) -> "Limits":
        """From the config's `batching` section (shmserve.config.BatchingConfig)."""
        return cls(batching.max_batch_size, batching.max_batch_tokens,
                   batching.max_wait_ms / 1000.0, batching.max_pad_ratio)


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
    best = 0
    for i in range(1, len(queue)):
        if queue[i].priority > queue[best].priority:
            best = i
    return best


def wait_time(queue: Sequence[Text], now: float, limits: Limits) -> float:
    """Seconds to wait before forming a batch; 0 means form it now. The queue is not empty,
    and in arrival order."""
    if len(queue) >= limits.max_batch_size:
        return 0.0
    if sum(t.length for t in queue) >= limits.max_batch_tokens:
        return 0.0
    return max(0.0, queue[0].arrived + limits.max_wait_s - now)


def form_batch(queue: Sequence[T], limits: Limits,
               fair_turn: bool = False) -> tuple[Batch[T], list[T]]:
    """Split a non-empty queue (arrival order) into the next batch and the rest (arrival order)."""
    anchor = queue[anchor_index(queue, fair_turn)]
    same = sorted((t for t in queue if t.model == anchor.model), key=lambda t: t.length)
    lengths = [t.length for t in same]
    # Position of the anchor itself among equal lengths (identity, not equality).
    pos = bisect.bisect_left(lengths, anchor.length)
    while same[pos] is not anchor:
        pos += 1
    lo, hi = pos, pos  # the batch is same[lo:hi + 1]
    longest, real = anchor.length, max(anchor.length, 1)
    while hi - lo + 1 < limits.max_batch_size:
        count = hi - lo + 2
        options = []  # (padding it adds, side, new longest, text)
        if lo > 0:  # a shorter text pads itself up to the longest
            options.append((longest - same[lo - 1].length, -1, longest, same[lo - 1]))
        if hi + 1 < len(same):  # a longer text pads every text already in the batch
            text = same[hi + 1]
            options.append(((text.length - longest) * (count - 1), 1, text.length, text))
        for _, side, new_len, text in sorted(options, key=lambda o: o[0]):
            new_real = real + max(text.length, 1)
            padded = new_len * count
            if padded <= limits.max_batch_tokens and padded <= limits.max_pad_ratio * new_real:
                lo, hi = (lo - 1, hi) if side < 0 else (lo, hi + 1)
                longest, real = new_len, new_real
                break
        else:
            break
    chosen = same[lo:hi + 1]
    taken = {id(t) for t in chosen}
    rest = [t for t in queue if id(t) not in taken]
    return Batch(chosen, max(t.length for t in chosen)), rest


def form_pass(queue: Sequence[T], limits: Limits, fair_turn: bool = False,
              merges: Callable[[T], bool] = lambda text: False
              ) -> tuple[list[Batch[T]], list[T]]:
    """The next forward pass: its batches (length groups), and the rest of the queue (arrival
    order). One batch, unless `merges` says the first batch's model runs groups in one pass:
    then also the batches `form_batch` would form next, while they are of that model and the
    pass stays within the limits."""
    first, rest = form_batch(queue, limits, fair_turn)
    batches = [first]
    texts, padded = len(first.texts), first.padded_tokens
    merge = merges(first.texts[0])
    while merge and rest:
        nxt, after = form_batch(rest, limits)
        if (nxt.texts[0].model != first.texts[0].model
                or texts + len(nxt.texts) > limits.max_batch_size
                or padded + nxt.padded_tokens > limits.max_batch_tokens):
            break
        batches.append(nxt)
        rest = after
        texts, padded = texts + len(nxt.texts), padded + nxt.padded_tokens
    return batches, rest
