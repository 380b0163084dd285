"""Every message that crosses the frontend/worker process boundary.

Logic-free by design: frozen, slotted dataclasses and the closed sets (IntEnums) they use.
`shmserve.wire` turns them into ZeroMQ frames and back. Requests are columnar: one message
carries all texts of a request as one flat int32 token buffer plus offsets, both in shared memory.

Exchange, frontend (DEALER, one per worker) <-> worker (ROUTER):
    Ping      ->                 every heartbeat interval
              <- Heartbeat       at once, from the worker's socket thread, even mid-batch
    Submit    ->                 one request; its buffers live in the frontend's arena
              <- Result | Error  exactly one terminal reply per Submit, aborted ones included
    Abort     ->                 best effort: drop the request if it has not run yet
    Reload    ->                 load new weights for a model into a standby slot and warm it
              <- ReloadDone      once staged (or failed); the active slot serves meanwhile
    Commit    ->                 switch to the staged slot (keep) or drop it, between batches
              <- ReloadDone
A reload is two-phase so that a model switches on every worker or on none: the frontend commits
only once every worker has staged the new weights (frontend.reload).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import IntEnum

PROTOCOL_VERSION = 15  # 3: a worker sends a batch's replies to a frontend as one message;
# 4: ErrorCode.OUT_OF_MEMORY; 5: Heartbeat.pass_s, and a rerank row is the raw logit (the
# frontend applies the activation), not the score; 6: Heartbeat's admission estimate (drain_rate,
# drain_pass_s, queued_tokens), a classification row is the raw logits (the frontend applies
# the softmax), and Ping names its frontend and pid; 8: Submit.raw; 9: Closing and ClosingSeen;
# 10: ModelInfo.loader; 11: Heartbeat.failure; 12: Submit.skip; 13: Heartbeat.unloaded and
# ErrorCode.PAST_DEADLINE; 14: Submit.alone and RUNNING_MARK; 15: Heartbeat.small_at


class Kind(IntEnum):
    """The first frame of every message: routes it before anything is decoded."""

    PING = 1
    HEARTBEAT = 2
    SUBMIT = 3
    RESULT = 4
    ERROR = 5
    ABORT = 6
    RELOAD = 7
    COMMIT = 8
    RELOAD_DONE = 9
    CLOSING = 10
    CLOSING_SEEN = 11


class ErrorCode(IntEnum):
    """Why a worker failed one request. `frontend.errors` maps each to an HTTP status."""

    INVALID = 1
    OVERLOADED = 2
    DEADLINE = 3
    UNKNOWN_MODEL = 4
    ABORTED = 5
    UNAVAILABLE = 6  # loading or draining: try another worker
    INTERNAL = 7
    OUT_OF_MEMORY = 8  # one text alone was too large for the device's free memory
    PAST_DEADLINE = 9  # refused at admission: the work queued ahead would not let it finish in
                       # time (workers.refuse_past_deadline); OVERLOADED: its queue was full


class ReloadStatus(IntEnum):
    """How a Reload or Commit went at one worker. `frontend.reload` maps each to an HTTP status."""

    OK = 0
    INVALID = 1  # the source cannot be served: path, format, corrupt weights, incompatible
    BUSY = 2  # another reload of this model is loading or staged on this worker
    FAILED = 3  # the worker could not load it (out of memory, ...)


# A request's priority (Submit.priority; X-Priority, a body's "priority",
# frontends.default_priority, shmserve.client): higher runs first.
PRIORITY_NAMES = {"low": -1, "normal": 0, "high": 1}
PRIORITY_RANGE = (-10, 10)


_DECIMAL = re.compile(r"[+-]?[0-9]{1,6}")


def priority_level(value: object) -> int | None:
    """A priority as given: low, normal or high (any case), or an integer in PRIORITY_RANGE
    (or its decimal text in ASCII digits: int() also reads "1_0" and other scripts' digits);
    None: not one."""
    if isinstance(value, str):
        name = value.strip().lower()
        if name in PRIORITY_NAMES:
            return PRIORITY_NAMES[name]
        if not _DECIMAL.fullmatch(name):
            return None
        value = int(name)
    if isinstance(value, int) and not isinstance(value, bool) and \
            PRIORITY_RANGE[0] <= value <= PRIORITY_RANGE[1]:
        return value
    return None

@dataclass(frozen=True, slots=True)
class ShmHandle:
    """Where a tensor lives: a byte range of a named arena, read as dtype and shape."""

    arena: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    task: str
    dim: int
    max_tokens: int
    dtype: str
    revision: str  # what the active slot serves
    state: str  # ready | loading (a reload is loading into standby) | staged (awaits commit)
    standby: str  # the revision loading or staged, "" when none
    loader: str = ""  # what loaded the active slot's network: shmserve | transformers


@dataclass(frozen=True, slots=True)
class Unloaded:
    """A model a serving worker hosts and could not load: it serves its others meanwhile, and
    tries this one again after `retry_in_s` (gpu_workers.loading.Retries)."""

    model: str
    error: str
    failures: int  # in a row, in this process
    retry_in_s: float  # from the heartbeat; 0: being tried now
    source: str = ""  # the run state's source it last tried (a reload's); "": the config's


@dataclass(frozen=True, slots=True)
class Ping:
    sent_at: float
    frontend: int = -1  # who pings, for the workers' watch on frontends (shmserve.hung)
    pid: int = 0


@dataclass(frozen=True, slots=True)
class Queued:
    priority: int
    tokens: int  # admitted at this priority and not yet computed


@dataclass(frozen=True, slots=True)
class Heartbeat:
    protocol_version: int
    worker: int
    pid: int
    ready: bool
    device: str
    models: tuple[ModelInfo, ...]
    queued_texts: int
    queue_limit: int
    ping_sent_at: float
    pass_s: float  # how long the forward pass running now has run; 0: none runs. The socket
                   # thread answers even while the model thread is stuck (a CUDA hang): this
                   # tells the frontends so (workers.stalled_pass_s)
    # The worker's admission estimate (shmserve.admission), for the frontends to refuse early a
    # request it would refuse, before tokenizing it: the speed it drains a backlog at (tokens/s;
    # 0: none measured) and a backlogged pass's time, and its admitted tokens by priority.
    drain_rate: float = 0.0
    drain_pass_s: float = 0.0
    queued_tokens: tuple[Queued, ...] = ()
    # Its load failed ("ModelSourceError: ..."): sent while it waits before exiting, so that
    # /ready names the error (gpu_workers.worker); "" otherwise
    failure: str = ""
    # Its models that failed to load while others did: it serves those (ready), not these
    unloaded: tuple[Unloaded, ...] = ()
    # When (time.time()) it was last sent a request of fewer than frontends.spread_part_texts
    # texts, from any frontend: interactive traffic, beside which no frontend spreads a large
    # request (frontend.dispatch.Dispatcher.run); 0.0: none yet
    small_at: float = 0.0

    @property
    def queued(self) -> int:
        """Tokens admitted and not yet computed, at every priority."""
        return sum(q.tokens for q in self.queued_tokens)


@dataclass(frozen=True, slots=True)
class Submit:
    seq: int  # unique per frontend process: matches the reply
    request_id: str  # the HTTP request id, for log lines in every process
    model: str  # a unit: MODEL, or MODEL@VARIANT (shmserve.models)
    token_ids: ShmHandle  # int32 [total_tokens]
    offsets: ShmHandle  # int32 [n_texts + 1]
    output: ShmHandle  # float32 [n_texts, dim] (per_token: [total_tokens, dim]), written by
                       # the worker
    deadline: float  # unix time; work still queued past it is answered DEADLINE
    priority: int  # higher runs first
    # int32 [n_texts]: tokens of each text's first segment (a cross-encoder's query with its
    # special tokens); the rest get token type 1. Shape (0,) for single-segment inputs.
    segments: ShmHandle
    # An embedding model's last hidden state for every token (TEI's /embed_all), not one pooled
    # row per text: output row offsets[i] + j is text i's token j.
    per_token: bool = False
    # An embedding model that L2-normalises its vectors: this request's rows without it (TEI's
    # `normalize: false`). A pass never mixes these rows with normalised ones.
    raw: bool = False
    # Leading tokens of every text that the pooling leaves out: a prompt's, with the special
    # token before it, for a model whose pooling excludes the prompt (ModelSpec.skips_prompt).
    # A pass never mixes requests of different skips.
    skip: int = 0
    # Run in a pass of its own (its own texts only): it was in the pass of a worker that died
    # (frontend.dispatch), and may be what killed it.
    alone: bool = False


# What a worker writes into the first 32 bits of each text's first output row as the pass that
# runs the text begins (a NaN's bits, which no row it answers holds: those are checked finite),
# and the frontend clears before it sends the request: found there once the worker is gone,
# the text was in the pass that was running when it died.
RUNNING_MARK = 0x7FC5EED5


@dataclass(frozen=True, slots=True)
class Result:
    seq: int
    queue_ms: float  # in the worker, not in its passes: before the first and between them
    inference_ms: float  # sum of the forward passes the request's texts ran in
    batch_size: int  # texts in the largest batch the request ran in
    tokens: int
    revision: str  # of the weights that computed every row (a request never mixes revisions)


@dataclass(frozen=True, slots=True)
class Error:
    seq: int
    code: ErrorCode
    message: str
    retry_after_s: int = 0  # OVERLOADED: when the client may send it again (0: not said)


@dataclass(frozen=True, slots=True)
class Abort:
    seq: int


@dataclass(frozen=True, slots=True)
class Reload:
    seq: int
    ticket: str  # names this reload in its Commit; the same on every worker
    model: str  # a unit
    source: str  # "" : the unit's current source, read again
    revision: str  # "" : a digest of the new weights


@dataclass(frozen=True, slots=True)
class Commit:
    seq: int
    ticket: str
    model: str
    keep: bool  # True: switch to the staged slot; False: drop it (or stop its loading)


@dataclass(frozen=True, slots=True)
class ReloadDone:
    seq: int
    status: ReloadStatus
    revision: str  # staged or now active
    message: str


@dataclass(frozen=True, slots=True)
class Closing:
    """A worker's last message to a frontend: everything it owes that frontend came before (the
    socket keeps order), and it reads nothing more. It keeps its connection open until the
    frontend says it has read this (ClosingSeen), or a moment has passed: ZeroMQ drops what a
    frontend has not yet read from a connection that drops (its sockets are IMMEDIATE), and a
    device error's 500 was lost that way, failed over and answered 503."""

    worker: int
    pid: int
    # Every request it took was answered, or never ran (a stop, a device error). False: it
    # failed on something unforeseen mid-pass, and what it held may have run: a frontend
    # counts those as a lost worker's (frontends.retry_on_worker_loss).
    answered: bool = True


@dataclass(frozen=True, slots=True)
class ClosingSeen:
    frontend: int


Message = (Ping | Heartbeat | Submit | Result | Error | Abort | Reload | Commit | ReloadDone
           | Closing | ClosingSeen)

KIND_OF: dict[type, Kind] = {
    Ping: Kind.PING,
    Heartbeat: Kind.HEARTBEAT,
    Submit: Kind.SUBMIT,
    Result: Kind.RESULT,
    Error: Kind.ERROR,
    Abort: Kind.ABORT,
    Reload: Kind.RELOAD,
    Commit: Kind.COMMIT,
    ReloadDone: Kind.RELOAD_DONE,
    Closing: Kind.CLOSING,
    ClosingSeen: Kind.CLOSING_SEEN,
}
