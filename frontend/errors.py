"""The two error families, and the one place that maps them to HTTP.

* `ApiError`: one request fails (bad input, overload, deadline...). Its `kind` decides the
  status through `STATUS`; the body is OpenAI's error shape,
  ``{"error": {"message", "type", "param", "code"}}`` (its `type` values are ours, `param` and
  `code` are null when unset), with the message again at the top level (`body`), on
  every route but KServe v2's: under /v2 the protocol's ``{"error": "<message>"}``
  (`kserve_body`; frontend.app.error_response picks by path).
* `WorkerGone` (in `frontend.links`): a worker died with requests pending; the dispatcher retries
  them elsewhere, and only turns it into an `ApiError("unavailable")` when no worker is left.
"""

from __future__ import annotations

from typing import Any

from shmserve.protocol import ErrorCode

STATUS: dict[str, int] = {
    "bad_request": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "method_not_allowed": 405,
    "conflict": 409,
    "too_large": 413,
    "unsupported_media_type": 415,
    "invalid_request": 422,
    "overloaded": 429,
    "internal_error": 500,
    "unavailable": 503,
    "timeout": 504,
    "insufficient_memory": 507,  # as TorchServe answers a device out of memory
}

_FROM_WORKER: dict[ErrorCode, str] = {
    ErrorCode.INVALID: "internal_error",  # the frontend built the buffers: a bug, not bad input
    ErrorCode.OVERLOADED: "overloaded",
    ErrorCode.PAST_DEADLINE: "overloaded",
    ErrorCode.DEADLINE: "timeout",
    ErrorCode.UNKNOWN_MODEL: "not_found",
    ErrorCode.ABORTED: "timeout",
    ErrorCode.UNAVAILABLE: "unavailable",
    ErrorCode.INTERNAL: "internal_error",
    ErrorCode.OUT_OF_MEMORY: "insufficient_memory",
}


# What set a deadline that is the client's own (frontend.request_headers.timeout)
CLIENT_DEADLINES = ("X-Request-Timeout", "parameters.timeout")


class ApiError(Exception):
    def __init__(self, kind: str, message: str, param: str | None = None,
                 retry_after: int | None = None, code: str | None = None,
                 attempts: int = 1, reason: str | None = None) -> None:
        super().__init__(message)
        if kind not in STATUS:
            raise ValueError(f"unknown error kind {kind!r}")
        self.kind = kind
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.code = code  # a finer machine-readable reason, e.g. "model_not_found"
        self.attempts = attempts  # times a worker was sent the request (access line, if > 1)
        # why a refusal (429, 503) was made, for the access line only: the reason
        # shmserve_frontend_refused_total counts it under, or the worker's error code
        self.reason = reason
        self.worker: int | None = None  # the worker that failed it, if one did (access line)
        self.final = False  # not to be sent again as it is (X-Should-Retry: false)

    @property
    def status(self) -> int:
        return STATUS[self.kind]

    def body(self) -> dict[str, Any]:
        # The message once more at the top level, where TEI's OpenAI-compatible route and
        # Cohere's API put it: pymilvus' TEI client read body["message"] (a KeyError, the
        # server's words lost: an outside check); OpenAI's clients read body["error"].
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}, "message": self.message}

    def kserve_body(self) -> dict[str, str]:
        """KServe v2's error shape: Triton's client joins the value into its exception's text, so
        it must be a string (an object there makes `str(exc)` raise TypeError)."""
        return {"error": self.message}

    def headers(self) -> dict[str, str]:
        if self.kind == "unauthorized":  # RFC 6750: say which scheme to use
            return {"WWW-Authenticate": 'Bearer realm="shmserve"'}
        if self.final:
            return {"X-Should-Retry": "false"}
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}

    @classmethod
    def deadline_passed(cls) -> "ApiError":
        """A request's deadline passed; its route names what set it (`set_by`)."""
        return cls("timeout", "request deadline passed")

    def told(self, message: str) -> "ApiError":
        """This error with another message, all else kept (a 504's X-Should-Retry was lost
        where the request id was added)."""
        error = ApiError(self.kind, message, self.param, self.retry_after, self.code,
                         self.attempts, self.reason)
        error.worker, error.final = self.worker, self.final
        return error

    def set_by(self, by: str) -> "ApiError":
        """This deadline's 504 naming what set the deadline, the one to raise
        (frontend.request_headers.timeout: the header, the protocol's parameter or the
        config): the dispatcher and the workers keep to a deadline without knowing where it
        came from."""
        error = self.told(f"{self.message} ({by})")
        # The client's own deadline: sent again, it passes again. openai-python's and its kin's
        # retries of every 5xx sent a 1 s request three times (an outside check); they obey
        # X-Should-Retry (OpenAI's API sends it). The server's own default stays retryable.
        error.final = by in CLIENT_DEADLINES
        return error

    @classmethod
    def from_worker(cls, code: ErrorCode, message: str, retry_after_s: int = 0) -> "ApiError":
        """A worker's refusal or failure; Retry-After for overloaded and unavailable: the
        worker's estimate where it gave one (shmserve.admission.retry_after_s), else 1 s."""
        kind = _FROM_WORKER.get(code, "internal_error")
        return cls(kind, message, retry_after=max(1, retry_after_s)
                   if kind in ("overloaded", "unavailable") else None,
                   reason=f"worker_{code.name.lower()}")


# OpenAI's own routes answer with its statuses (/embeddings: the same, at infinity's path)
OPENAI_PATHS = frozenset({"/v1/embeddings", "/embeddings"})
# Cohere's own routes (its /v1/rerank is shared with Jina's and the native clients: not here)
COHERE_PATHS = frozenset({"/v1/embed", "/v2/embed", "/v2/rerank"})
BAD_REQUEST_PATHS = OPENAI_PATHS | COHERE_PATHS


def status_on(path: str, exc: ApiError) -> int:
    """The status `exc` answers on `path`: its kind's, but 400 for an invalid request or one
    over a limit (too many inputs, a text too long) on OpenAI's and Cohere's routes, as those
    services answer: their clients raise BadRequestError for 400 and a bare APIStatusError
    (openai) or ApiError (cohere) for 413, which code catching BadRequestError missed (outside
    checks). TEI, and this server elsewhere, answer 422 and 413. A body over its size (one that
    inflates past nginx.client_max_body_size: an error naming no parameter) is 413 on every
    route, as nginx's own answer for a body sent over it."""
    if path in BAD_REQUEST_PATHS and (exc.kind == "invalid_request" or
                                      exc.kind == "too_large" and exc.param is not None):
        return 400
    return exc.status


def kserve_shaped(path: str) -> bool:
    """Whether errors on `path` take KServe v2's shape: every path under /v2, matched route or
    not (its clients read a 401 or an unknown path there too), but Cohere's /v2/rerank and
    /v2/embed (frontend.scores, frontend.cohere). nginx's own pages follow the same rule
    (nginx/nginx.conf)."""
    return (path == "/v2" or path.startswith("/v2/")) and path not in COHERE_V2


COHERE_V2 = ("/v2/rerank", "/v2/embed")


def status_of(exc: BaseException) -> int:
    """The HTTP status for any exception a handler lets escape (500 when it is not an ApiError)."""
    return exc.status if isinstance(exc, ApiError) else 500
