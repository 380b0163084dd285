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
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

PROTOCOL_VERSION = 1


class Kind(IntEnum):
    """The first frame of every message: routes it before anything is decoded."""

    PING = 1
    HEARTBEAT = 2
    SUBMIT = 3
    RESULT = 4
    ERROR = 5
    ABORT = 6


class ErrorCode(IntEnum):
    """Why a worker failed one request. `frontend.errors` maps each to an HTTP status."""

    INVALID = 1
    OVERLOADED = 2
    DEADLINE = 3
    UNKNOWN_MODEL = 4
    ABORTED = 5
    UNAVAILABLE = 6  # loading or draining: try another worker
    INTERNAL = 7


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
    revision: str


@dataclass(frozen=True, slots=True)
class Ping:
    sent_at: float


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


@dataclass(frozen=True, slots=True)
class Submit:
    seq: int  # unique per frontend process: matches the reply
    request_id: str  # the HTTP request id, for log lines in every process
    model: str
    token_ids: ShmHandle  # int32 [total_tokens]
    offsets: ShmHandle  # int32 [n_texts + 1]
    output: ShmHandle  # float32 [n_texts, dim], written by the worker
    deadline: float  # unix time; work still queued past it is answered DEADLINE
    priority: int  # higher runs first


@dataclass(frozen=True, slots=True)
class Result:
    seq: int
    queue_ms: float  # enqueue to start of the request's first batch
    inference_ms: float  # sum of the forward passes the request's texts ran in
    batch_size: int  # texts in the largest batch the request ran in
    tokens: int


@dataclass(frozen=True, slots=True)
class Error:
    seq: int
    code: ErrorCode
    message: str


@dataclass(frozen=True, slots=True)
class Abort:
    seq: int


Message = Ping | Heartbeat | Submit | Result | Error | Abort

KIND_OF: dict[type, Kind] = {
    Ping: Kind.PING,
    Heartbeat: Kind.HEARTBEAT,
    Submit: Kind.SUBMIT,
    Result: Kind.RESULT,
    Error: Kind.ERROR,
    Abort: Kind.ABORT,
}
