"""A request as a worker holds it: its shared-memory buffers, read and checked once when it
arrives, and its texts as the batcher queues them."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from gpu_workers.slots import Slot
from shmserve.arena import Attachments
from shmserve.protocol import RUNNING_MARK, Error, ErrorCode, Submit

log = logging.getLogger("shmserve.worker")


@dataclass(slots=True, eq=False)
class Request:
    peer: bytes
    msg: Submit
    ids: np.ndarray
    offsets: np.ndarray  # a private copy (read_request)
    lengths: np.ndarray  # token counts of its texts, from those offsets
    out: np.ndarray
    arrived: float
    remaining: int
    segments: np.ndarray | None = None  # first-segment lengths of text pairs
    slot: Slot | None = None  # pinned when the model thread takes the request in
    started: float = 0.0
    inference_ms: float = 0.0
    batch_size: int = 0
    done: bool = False
    aborted: bool = False
    orphaned: bool = False  # its frontend is gone: off the queue bound (Intake.orphan)
    released_tokens: int = 0  # its tokens_left when orphaned, taken off the backlog then
    tokens_left: int = 0  # admitted and not yet computed (shmserve.admission)
    marks: np.ndarray | None = None  # the first 32 bits of every output row (mark_running)

    def rows(self, index: int) -> np.ndarray:
        """Where text `index`'s output goes in shared memory: its row, or (per_token) its
        tokens' rows, at its token offsets."""
        if self.msg.per_token:
            return self.out[self.offsets[index]:self.offsets[index + 1]]
        return self.out[index]


def mark_running(texts: list[QueuedText]) -> None:
    """Write protocol.RUNNING_MARK into each text's first output row, as its pass begins: the
    rows its pass answers overwrite it; a frontend that finds it after this worker died knows
    the text was in the pass that was running (frontend.dispatch: a request that may have
    killed the worker is sent again alone, and not a third time)."""
    for text in texts:
        request = text.request
        if request.marks is None:
            request.marks = request.out.view(np.uint32)[:, 0]
        request.marks[request.offsets[text.index] if request.msg.per_token
                      else text.index] = RUNNING_MARK


def pass_rows(out: np.ndarray, texts: list[QueuedText], per_token: bool):
    """A pass's output by text, in the texts' order: row j (pooled), or text j's tokens' rows
    (per_token: the rows come text after text)."""
    if not per_token:
        return out
    return np.split(out, np.cumsum([t.length for t in texts[:-1]]))


def write_rows(out: np.ndarray | None, ok: list[bool], texts: list[QueuedText],
               per_token: bool, dtype: str,
               finish: Callable[[Request, Error], None]) -> tuple[dict[int, Request],
                                                                  dict[int, int]]:
    """A pass's output `out` (None: every text ran out of memory, see
    gpu_workers.memory.forward_in_halves; `ok[j]`: text j's row is there) into its requests'
    shared memory. A text that ran out of memory on its own, or whose row holds NaN or infinity,
    fails its request through `finish` (the rest of that request's texts are skipped). Returns
    the requests written to, by id, and the tokens computed, by priority (the backlog's)."""
    # One reduction, no temporary array, in the usual case (a NaN or infinity anywhere makes
    # the sum so; finite rows whose sum overflows only cost the row check).
    finite = None
    rows = pass_rows(out, texts, per_token) if out is not None else None
    if out is not None and not np.isfinite(out.sum()):
        finite = [bool(np.isfinite(r).all()) for r in rows]
    touched: dict[int, Request] = {}
    computed: dict[int, int] = {}
    for j, text in enumerate(texts):
        request = text.request
        if request.done:
            continue
        request.tokens_left -= text.length
        priority = request.msg.priority
        computed[priority] = computed.get(priority, 0) + text.length
        if not ok[j]:
            log.warning("forward.out_of_memory", extra={"fields": {
                "request_id": request.msg.request_id, "tokens": text.length}})
            finish(request, Error(
                request.msg.seq, ErrorCode.OUT_OF_MEMORY,
                f"the device ran out of memory running a text of {text.length} tokens "
                "on its own"))
            touched.pop(id(request), None)
            continue
        if finite is not None and not finite[j]:  # JSON would answer it as nulls
            log.error("forward.non_finite", extra={"fields": {
                "request_id": request.msg.request_id, "tokens": text.length,
                "dtype": dtype}})
            finish(request, Error(
                request.msg.seq, ErrorCode.INTERNAL,
                f"the model's output for a text of {text.length} tokens holds NaN or "
                f"infinity (in {dtype})"))
            touched.pop(id(request), None)
            continue
        request.rows(text.index)[...] = rows[j]
        request.remaining -= 1
        touched[id(request)] = request
    return touched, computed


@dataclass(slots=True, eq=False)
class QueuedText:
    request: Request
    index: int
    length: int
    model: str = field(init=False)
    priority: int = field(init=False)
    arrived: float = field(init=False)

    def __post_init__(self) -> None:
        # Batches group by slot (one revision each), and per-token requests apart (their pass
        # gives every token's row, not one pooled row per text), and so raw ones (their pass
        # skips the model's normalisation) and those whose pooling skips another number of
        # leading tokens (a prompt's: Submit.skip); a request sent alone (Submit.alone) apart
        # from every other.
        msg = self.request.msg
        self.model = self.request.slot.key + ("+tokens" if msg.per_token else
                                               "+raw" if msg.raw else "") + (
            f"+skip{msg.skip}" if msg.skip and not msg.per_token else "") + (
            f"+alone{id(self.request)}" if msg.alone else "")  # batched with no other
        self.priority = self.request.msg.priority
        self.arrived = self.request.arrived


def read_request(attachments: Attachments, peer: bytes, msg: Submit, now: float,
                 width: int) -> Request:
    """The Submit's buffers as a Request; ValueError (OSError: a segment that cannot be
    attached) when they disagree, or its output rows are not `width` (the model's) wide: a
    pass writes them whole, and a row that did not fit failed the pass and the worker. The
    offsets and segments are copied: every length this worker computes comes from one reading
    of them, so whatever happens to the shared slot later cannot make them disagree (a
    crash)."""
    offsets = attachments.view(msg.offsets).copy()
    ids = attachments.view(msg.token_ids)
    out = attachments.view(msg.output)
    segments = attachments.view(msg.segments).copy() if msg.segments.shape[0] else None
    n = offsets.shape[0] - 1
    lengths = np.diff(offsets)
    rows = int(offsets[-1]) if msg.per_token and n >= 1 else n
    if out.ndim != 2 or out.shape[1] != width:
        raise ValueError(f"output of shape {tuple(out.shape)}: the model's rows are {width} "
                         "wide")
    if n < 1 or out.shape[0] != rows or int(offsets[-1]) > ids.shape[0] or (
            offsets[0] != 0 or (lengths <= 0).any()) or segments is not None and (
            segments.shape[0] != n or (segments < 1).any() or (segments > lengths).any()):
        raise ValueError("offsets, ids, segments and output disagree")
    return Request(peer, msg, ids, offsets, lengths, out, now, n, segments)


def model_inputs(batches, texts: list[QueuedText]
                 ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """A pass's length groups (gpu_workers.batcher.Batch, whose `texts` are all of `texts`) as
    the model takes them: padded int64 ids, lengths, and first-segment lengths when any text is
    a pair. A classifier's requests may mix pairs and single texts: a single text's first
    segment is the whole text."""
    pairs = any(text.request.segments is not None for text in texts)
    groups = []
    for batch in batches:
        ids = np.zeros((len(batch.texts), batch.padded_len), np.int64)
        lengths = np.empty(len(batch.texts), np.int64)
        segments = np.empty(len(batch.texts), np.int64) if pairs else None
        for j, text in enumerate(batch.texts):
            offsets = text.request.offsets
            start, end = offsets[text.index], offsets[text.index + 1]
            ids[j, :end - start] = text.request.ids[start:end]
            lengths[j] = end - start
            if pairs:
                first = text.request.segments
                segments[j] = end - start if first is None else first[text.index]
        groups.append((ids, lengths, segments))
    return groups
