"""What shmserve's native API answers, decoded for shmserve.client: the error every failure
raises (status, error body, Retry-After), and a response body as numpy arrays (vectors, class
probabilities, scores, token rows, sparse vectors). Re-exported by shmserve.client."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import msgpack
import numpy as np

MAX_RETRY_WAIT_S = 60.0


class SparseVector(NamedTuple):
    """A sparse model's vector: its non-zero values by vocabulary index, in index order."""

    indices: np.ndarray  # int64 [non-zeros]
    values: np.ndarray  # float32 [non-zeros]

    def dense(self, size: int) -> np.ndarray:
        """As a float32 [size] vector (size: the model's vocabulary, GET /info's dim)."""
        if len(self.indices) and self.indices[-1] >= size:
            raise ValueError(f"index {int(self.indices[-1])} is past a vector of {size}; "
                             "size is the model's vocabulary (GET /info's dim)")
        out = np.zeros(size, np.float32)
        out[self.indices] = self.values
        return out


class ShmserveError(Exception):
    """The server refused a request (status and error body set), or could not be reached."""

    def __init__(self, message: str, status: int | None = None,
                 body: dict[str, Any] | None = None, retry_after: float | None = None) -> None:
        super().__init__(f"{status} {message}" if status is not None else message)
        self.status = status
        self.body = body
        self.retry_after = retry_after  # seconds, from the answer's Retry-After
        error = body.get("error") if isinstance(body, dict) else None
        error = error if isinstance(error, dict) else {}
        self.message = error.get("message", message)
        self.type = error.get("type")  # "invalid_request", "overloaded", ...
        self.param = error.get("param")
        self.code = error.get("code")


Answer = tuple[int, str, bytes, "str | None"]  # status, Content-Type, body, Retry-After


def _wait_s(retry_after: str | None) -> float:
    """A Retry-After's seconds (1 when absent or a date, which this server never sends)."""
    try:
        wait = float(retry_after) if retry_after is not None else 1.0
    except ValueError:
        wait = 1.0
    return min(max(wait, 0.0), MAX_RETRY_WAIT_S) if wait == wait else 1.0


def _decode(status: int, content_type: str, raw: bytes, retry_after: str | None = None) -> Any:
    """The body of a response, or ShmserveError for any status but 200."""
    try:
        if "msgpack" in content_type:
            body = msgpack.unpackb(raw, raw=False)
        else:
            body = json.loads(raw) if raw else None
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ShmserveError(f"unreadable {content_type or 'untyped'} response: {exc}",
                            status) from None
    if status != 200:
        message = f"HTTP {status}"
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            message = str(body["error"].get("message", message))
        raise ShmserveError(message, status, body if isinstance(body, dict) else None,
                            _wait_s(retry_after) if retry_after is not None else None)
    return body


def _classes(body: dict[str, Any], single: bool) -> tuple[np.ndarray, list[str]]:
    """/v1/classify's answer as (probabilities float32 [n, labels], or [labels] for one string
    as embed gives [dim], label names by column).
    `probs` is by class index and `labels` (all of them: no top_k is sent) best first, ranked
    by the server with numpy's stable argsort, which ranks the same probabilities here."""
    data = body["data"]
    probs = np.asarray([d["probs"] for d in data], dtype=np.float32).reshape(len(data), -1)
    names = [""] * probs.shape[1]
    for rank, column in enumerate(np.argsort(-probs[0], kind="stable").tolist()):
        names[column] = data[0]["labels"][rank]["label"]
    return (probs[0] if single else probs), names


def _scores(body: dict[str, Any], count: int) -> np.ndarray:
    """/v1/rerank's answer (best first, with each document's index) in input order."""
    scores = np.empty(count, dtype=np.float32)
    for result in body["results"]:
        scores[result["index"]] = result["relevance_score"]
    return scores


def _token_rows(body: list[list[Any]], single: bool) -> np.ndarray | list[np.ndarray]:
    """/embed_all's answer: float32 [tokens, dim] per text."""
    out = [np.stack([np.frombuffer(r, "<f4") for r in rows]) if rows and isinstance(
        rows[0], bytes) else np.asarray(rows, dtype=np.float32) for rows in body]
    return out[0] if single else out


def _sparse(body: list, single: bool) -> list[SparseVector] | SparseVector:
    out = [SparseVector(np.array([v["index"] for v in row], np.int64),
                        np.array([v["value"] for v in row], np.float32)) for row in body]
    return out[0] if single else out


def _matrix(body: dict[str, Any], single: bool) -> np.ndarray:
    rows = body["results"]
    if rows and isinstance(rows[0], list) and rows[0] and isinstance(rows[0][0], dict):
        message = (f"model {body.get('model')!r} is a classification model: /predict "
                   "answered its labels, not vectors; use classify()")
        # an answer came (200): said with its status, typed as /v1/embeddings refuses it
        raise ShmserveError(message, 200, {"error": {
            "message": message, "type": "invalid_request", "param": "model",
            "code": "unsupported_task"}})
    if rows and isinstance(rows[0], bytes):  # msgpack: raw little-endian float32
        matrix = np.stack([np.frombuffer(r, "<f4") for r in rows])
    else:
        matrix = np.asarray(rows, dtype=np.float32)
    return matrix[0] if single else matrix
