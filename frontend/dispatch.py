"""One request's trip to a worker and back: shared-memory slot, worker choice, retries, deadline
(a large one at light load: its parts' trips to the idle workers at once, `Dispatcher.run`).

The slot (token ids, offsets, output rows) is allocated once per request and freed when nobody
can touch it any more: the handler is done with it and no worker holds it (see `Lease`). A
request whose worker dies is resubmitted to another live worker, up to
`frontends.retry_on_worker_loss` times: inference is idempotent. One that a worker turned away
without running it goes to another ready worker besides: once when it was refused for its load
(429), and once a worker when the worker was loading or draining. A resubmission
gets output rows of its own: a worker failed over for silence may resume and write the rows it
was given (its slot stays held until it answers or is gone), and those must not be the rows the
next worker's answer is read from.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, replace

import numpy as np

from frontend import metrics
from frontend.errors import ApiError
from frontend.links import (Stopped, WorkerClosed, WorkerGone, WorkerLink, consume,
                            did_not_load)
from frontend.pool import WorkerPool
from frontend.tokenizer import Encoded
from shmserve.arena import Arena, ArenaFull, ShmFull
from shmserve.config import Config
from shmserve.protocol import RUNNING_MARK, Error, ErrorCode, Result, Submit

log = logging.getLogger("shmserve.frontend")


@dataclass(frozen=True, slots=True)
class Outcome:
    vectors: np.ndarray  # float32 [n, dim] (per token: [tokens, dim]), a private copy
    result: Result
    worker: int
    received_at: float  # perf_counter when the reply was back in the handler
    attempts: int = 1  # 2 or more: sent again after a lost or unavailable worker
    workers: tuple[int, ...] = ()  # a spread request's: each part's worker, in order

    @property
    def revision(self) -> str:
        """Of the weights that computed every row."""
        return self.result.revision


class Lease:
    """A slot's holders: the handler plus each worker that may still write to it."""

    def __init__(self, arena: Arena, offset: int) -> None:
        self._arena, self._offset, self._holders = arena, offset, 1

    def hold(self) -> None:
        self._holders += 1

    def release(self) -> None:
        self._holders -= 1
        if self._holders == 0:
            self._arena.free(self._offset)


# A request's output rows may take at most this fraction of the arena (1/4): a larger one would
# hold most of it, and other requests would be refused as if the frontend were busy. Per-token
# rows (/embed_all) and a sparse model's vocabulary-wide rows (122 KB a text) reach it.
OUTPUT_SHARE = 4


def _clear_marks(rows: np.ndarray, first_rows) -> None:
    """Zero the first 32 bits of each text's first row (`first_rows` of `rows`), where a
    worker writes protocol.RUNNING_MARK as the text's pass begins: the arena's bytes may hold
    an earlier request's mark."""
    rows.view(np.uint32)[first_rows, 0] = 0


def _marked(rows: np.ndarray, first_rows) -> bool:
    """Whether any text's first row holds protocol.RUNNING_MARK: it was in the pass that ran
    when its worker was lost (a row it answered replaces the mark)."""
    return bool((rows.view(np.uint32)[first_rows, 0] == RUNNING_MARK).any())


def _on(link: WorkerLink, error: ApiError) -> ApiError:
    """`error`, naming the worker that failed the request (its access line's `worker`)."""
    error.worker = link.index
    return error


def _align(n: int) -> int:
    return -(-n // 64) * 64


# A worker's refusals at admission: another worker may take the request (once).
REFUSALS = (ErrorCode.OVERLOADED, ErrorCode.PAST_DEADLINE)


class Dispatcher:
    def __init__(self, cfg: Config, pool: WorkerPool, arena: Arena) -> None:
        self.cfg = cfg
        self.pool = pool
        self.arena = arena
        self._small_at = 0.0  # when a request of under spread_part_texts texts came (time())

    async def run(self, model: str, dim: int, enc: Encoded, request_id: str, deadline: float,
                  priority: int = 0, per_token: bool = False, raw: bool = False) -> Outcome:
        """`per_token`: a row for every token (Submit.per_token), not one a text. `raw`: an
        embedding model's rows without its own normalisation (Submit.raw).

        A large request at light load runs spread: cut into contiguous parts of about as many
        tokens, one for each idle worker of its model (`spread_cuts`), each sent as a request
        of its own (its own retries and refusals; one part's failure cancels the others and is
        the request's). The parts' rows are joined in order; parts that different weights
        answered (a reload committed on one worker before another) are not mixed: the whole
        request runs again on one worker. Only while no request of fewer than
        `spread_part_texts` texts came for `frontends.spread_quiet_s` (`_quiet`): with every
        worker running a part's pass, a query waited for one (on a CPU, 0.7-1.3 s at p50 beside
        a 1,000-text request, against 12-24 ms with an idle worker to go to: an outside check),
        so interactive traffic keeps spreading off."""
        n = int(enc.offsets[-1]) if per_token else enc.offsets.shape[0] - 1
        if n * dim * 4 > (most := self.arena.size // OUTPUT_SHARE):
            rows = "tokens" if per_token else "texts"
            raise ApiError("too_large", f"{n} {rows} x {dim} floats of output take "
                           f"{n * dim * 4:,} bytes, over the {most:,} a request may (a quarter "
                           f"of this frontend's shared memory, shm.arena_mb: at most "
                           f"{most // (dim * 4):,} {rows}); send fewer"
                           f"{' or shorter' * per_token} texts", param="inputs")
        args = (request_id, deadline, priority, per_token, raw)
        least, cuts = self.cfg.frontends.spread_part_texts, []
        if enc.count < least:  # (the one-text request's path looks at no worker)
            self._small_at = time.time()
        elif 0 < least and 2 * least <= enc.count:  # large enough to spread: is it, or why not
            if not self._quiet():
                metrics.spread("whole_for_queries").inc()
            elif not (cuts := spread_cuts(enc.offsets, self.pool.idle(model), least)):
                metrics.spread("whole_for_busy_workers").inc()
        if not cuts:
            return await self._run_one(model, dim, enc, *args)
        try:
            async with asyncio.TaskGroup() as group:
                # Each part's task picks its worker and submits before the next one runs, so
                # the least loaded worker (WorkerPool.pick) is another idle one each time.
                tasks = [group.create_task(self._run_one(model, dim, part, *args))
                         for part in split(enc, cuts)]
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
        outcomes = [task.result() for task in tasks]
        if len({outcome.revision for outcome in outcomes}) > 1:
            metrics.spread("mixed_revisions").inc()
            return await self._run_one(model, dim, enc, *args)
        metrics.spread("spread").inc()
        return joined(outcomes)

    def _quiet(self) -> bool:
        """No request of fewer than spread_part_texts texts for spread_quiet_s: to this
        frontend, nor (their heartbeats' `small_at`) to any worker from another. This
        frontend's own would not do: nginx (least_conn) sends the queries to the frontends
        not busy with the bulk client's requests, and the frontend that was kept spreading
        them (a second outside check)."""
        last = max([self._small_at, *(link.beat.small_at for link in self.pool.links
                                      if link.beat is not None)])
        return time.time() - last >= self.cfg.frontends.spread_quiet_s

    async def _run_one(self, model: str, dim: int, enc: Encoded, request_id: str,
                       deadline: float, priority: int, per_token: bool, raw: bool) -> Outcome:
        n = int(enc.offsets[-1]) if per_token else enc.offsets.shape[0] - 1
        off_bytes = _align(enc.offsets.nbytes)
        ids_bytes = _align(enc.ids.nbytes)
        seg_bytes = _align(enc.segments.nbytes) if enc.segments is not None else 0
        lease, base = self._alloc(off_bytes + ids_bytes + seg_bytes + n * dim * 4)
        leases = [lease]
        try:
            offsets = self.arena.handle(base, "int32", enc.offsets.shape)
            ids = self.arena.handle(base + off_bytes, "int32", enc.ids.shape)
            segments = self.arena.handle(base + off_bytes + ids_bytes, "int32",
                                         (n if enc.segments is not None else 0,))
            output = self.arena.handle(base + off_bytes + ids_bytes + seg_bytes, "float32",
                                       (n, dim))
            self.arena.view(offsets)[:] = enc.offsets
            self.arena.view(ids)[:] = enc.ids
            first_rows = enc.offsets[:-1] if per_token else slice(None)  # a text's first row
            _clear_marks(self.arena.view(output), first_rows)
            if enc.segments is not None:
                self.arena.view(segments)[:] = enc.segments
            refused = None  # the worker that turned it away for its load (429), if one did
            again = ""  # why the last attempt is to be sent again: the retry's reason
            # Each kind of hand-off has its own allowance: only a worker's loss counts against
            # frontends.retry_on_worker_loss. An overload's or a draining worker's hand-off used
            # one of those attempts, and on the last one its 429 came back as 503 "retries
            # exhausted" (with no retries configured, every overload did; a review found it).
            lost = unready = 0
            attempt = 0
            alone = False  # sent to run in a pass of its own (Submit.alone)
            sent_to: WorkerLink | None = None  # the worker of the last attempt
            while True:
                link = self.pool.pick(model, refused) or await self._wait_for_worker(
                    model, deadline, refused)
                if link is None:
                    if time.time() >= deadline:
                        raise ApiError("timeout", "deadline passed waiting for a worker")
                    loading = any(link.alive and not link.ready for link in self.pool.links)
                    lost_it = again == "worker_lost"  # its worker died with it in it
                    error = ApiError("unavailable", ("its worker was lost and " if lost_it else "")
                                     + ("no worker is ready for this model yet (loading or "
                                        "restarting)" if loading else
                                        "no live worker for this model"), retry_after=1,
                                     attempts=attempt,
                                     reason="worker_lost" if lost_it else "no_worker_ready")
                    raise _on(sent_to, error) if lost_it and sent_to else error
                if attempt:  # sent again, with rows of its own (see the module's docstring)
                    metrics.retries(again).inc()
                    out_lease, out_base = self._alloc(n * dim * 4)
                    leases.append(out_lease)
                    output = self.arena.handle(out_base, "float32", (n, dim))
                    _clear_marks(self.arena.view(output), first_rows)
                held = (lease, leases[-1]) if attempt else (lease,)
                for each in held:
                    each.hold()
                attempt += 1
                seq = self.pool.next_seq()
                msg = Submit(seq, request_id, model, ids, offsets, output, deadline, priority,
                             segments, per_token, raw, enc.skip, alone)
                future = self.pool.submit(link, msg, len(enc.ids),
                                        lambda held=held: _release(held))
                sent_to = link
                try:  # (not wait_for, which loses a cancel that comes as the reply does)
                    async with asyncio.timeout(max(0.0, deadline - time.time())):
                        reply = await asyncio.shield(future)
                except WorkerClosed:
                    # Its worker stopped and said it ran none of it (protocol.Closing): handed
                    # on as a draining worker's refusal is, not counted as a lost worker's.
                    unready += 1
                    if unready > len(self.pool.links):
                        raise ApiError("unavailable", "workers kept stopping", retry_after=1,
                                       attempts=attempt, reason="workers_stopping") from None
                    again = "unavailable"
                    continue
                except WorkerGone:
                    lost += 1
                    # In the pass that was running when its worker died (the worker's mark in
                    # its rows), the request may be what killed it: a poison input would take
                    # down a worker with every try, and the requests batched with it each time.
                    # So it goes again alone; lost again alone, it is not sent a third time.
                    running = _marked(self.arena.view(output), first_rows)
                    if running and alone:
                        metrics.suspects("failed").inc()
                        log.error("frontend.request_lost_its_worker_twice", extra={"fields": {
                            "request_id": request_id, "model": model, "worker": link.index,
                            "attempts": attempt}})
                        raise _on(link, ApiError(
                            "internal_error", "the worker running this request was lost "
                            "twice, the second time running it alone: its inputs may crash "
                            "the model, and it is not sent again", attempts=attempt,
                            code="worker_crashed", reason="worker_crashed")) from None
                    if lost > self.cfg.frontends.retry_on_worker_loss:
                        raise _on(link, ApiError(
                            "unavailable", "workers kept failing; retries exhausted "
                            "(frontends.retry_on_worker_loss)", retry_after=1,
                            attempts=attempt, reason="worker_lost")) from None
                    if running:
                        metrics.suspects("isolated").inc()
                        alone = True
                    again = "worker_lost"
                    continue
                except Stopped as exc:
                    raise ApiError("unavailable", str(exc), retry_after=1,
                                   attempts=attempt, reason="frontend_stopping") from None
                except asyncio.CancelledError:  # the client went away
                    self._abandon(link, seq, future)
                    raise
                except TimeoutError:
                    self._abandon(link, seq, future)
                    error = ApiError.deadline_passed()
                    error.attempts = attempt
                    raise _on(link, error) from None
                received = time.perf_counter()
                if (isinstance(reply, Error) and reply.code is ErrorCode.UNAVAILABLE
                        and unready < len(self.pool.links)):
                    # Loading or draining: a worker restarted faster than its heartbeats showed,
                    # or one stopping. It ran nothing; another worker (or it, once its next
                    # heartbeat says ready) takes the request. At most once a worker.
                    self.pool.mark_unready(link)
                    unready += 1
                    again = "unavailable"
                    continue
                if (isinstance(reply, Error) and reply.code in REFUSALS
                        and refused is None and any(
                            other is not link for other in self.pool.ready_links(model))):
                    # Its queue, or the work in it, is too much for this request: another
                    # worker's may not be (a frontend learns of the others' load from their
                    # heartbeats, which may be a moment old). Once; it ran nothing.
                    refused = link
                    again = "overloaded"
                    continue
                if isinstance(reply, Error):
                    error = ApiError.from_worker(reply.code, reply.message, reply.retry_after_s)
                    error.attempts = attempt
                    raise _on(link, error)
                vectors = self.arena.view(output).copy()
                return Outcome(vectors, reply, link.index, received, attempt)
        finally:
            _release(leases)

    async def _wait_for_worker(self, model: str, deadline: float,
                               refused: WorkerLink | None) -> WorkerLink | None:
        """No worker ready for `model` now: wait for one (frontends.no_worker_wait_s), unless
        it did not load on the workers that host it (answered at once, saying why). A wait
        its own deadline cut short ends in a 504: the server had no time to find a worker,
        which a 503 "no live worker" misstated (an outside check: a frontend just started,
        not yet told of the workers, said so of two live ones to a request of 20 ms; the
        timer that ends the wait may fire a moment before the deadline it was set for)."""
        why, retry_in = did_not_load(self.pool.links, model)
        if why:
            raise ApiError("unavailable", f"model {model!r} did not load ({why}); its workers "
                           "try it again",
                           retry_after=max(1, math.ceil(retry_in)), code="model_not_loaded",
                           reason="model_not_loaded")
        wait, left = self.cfg.frontends.no_worker_wait_s, deadline - time.time()
        link = await self.pool.wait_for_worker(model, min(wait, left), avoid=refused)
        if link is None and left < wait:
            raise ApiError("timeout", "deadline passed waiting for a worker")
        return link

    def _alloc(self, nbytes: int) -> tuple[Lease, int]:
        try:
            base = self.arena.alloc(nbytes)
        except ArenaFull:
            metrics.refused("arena").inc()
            raise ApiError("overloaded", "this frontend's shared memory is taken by the "
                           f"requests in flight ({self.arena.size >> 20} MiB, shm.arena_mb); "
                           "retry later", retry_after=1, reason="arena") from None
        except ShmFull as exc:  # the host's /dev/shm, not this request's doing: 503, logged
            metrics.refused("shm_full").inc()
            log.error("frontend.shm_full", extra={"fields": {"reason": str(exc)}})
            raise ApiError("unavailable", f"no shared memory for this request: {exc}",
                           retry_after=5, reason="shm_full") from None
        return Lease(self.arena, base), base

    def _abandon(self, link, seq: int, future: asyncio.Future) -> None:
        """Stop waiting; the worker keeps the slot until it answers the abort (or dies)."""
        future.add_done_callback(consume)
        self.pool.abort(link, seq)


def _release(leases) -> None:
    for lease in leases:
        lease.release()


def spread_cuts(offsets: np.ndarray, idle: int, least: int) -> list[int]:
    """Where to cut a request of texts at `offsets` (int32 [n + 1]) into parts for `idle`
    workers: the indices of the texts that begin the second part onwards, so that each part
    holds about as many tokens and at least `least` texts; [] when it is not to be spread (under
    two parts, or `least` 0)."""
    n = offsets.shape[0] - 1
    parts = min(idle, n // least) if least > 0 else 0
    if parts < 2:
        return []
    goals = int(offsets[-1]) * np.arange(1, parts) / parts
    cuts = np.searchsorted(offsets, goals)  # the first text whose start reaches each goal
    return [int(min(max(cut, least * i), n - least * (parts - i)))
            for i, cut in enumerate(cuts, 1)]


def split(enc: Encoded, cuts: list[int]) -> list[Encoded]:
    """`enc` as the parts `cuts` begin (spread_cuts), each with offsets of its own."""
    bounds = [0, *cuts, enc.count]
    parts = []
    for first, end in zip(bounds, bounds[1:]):
        lo, hi = int(enc.offsets[first]), int(enc.offsets[end])
        parts.append(Encoded(enc.ids[lo:hi], enc.offsets[first:end + 1] - lo, 0,
                             None if enc.segments is None else enc.segments[first:end],
                             enc.skip))
    return parts


def joined(outcomes: list[Outcome]) -> Outcome:
    """A spread request's outcome from its parts': the rows in order; the timings of the part
    answered last (the stages of the request's critical path), its largest batch, every
    token."""
    last = max(outcomes, key=lambda outcome: outcome.received_at)
    result = replace(last.result, batch_size=max(o.result.batch_size for o in outcomes),
                     tokens=sum(o.result.tokens for o in outcomes))
    return Outcome(np.concatenate([o.vectors for o in outcomes]), result, last.worker,
                   last.received_at, max(o.attempts for o in outcomes),
                   tuple(o.worker for o in outcomes))
