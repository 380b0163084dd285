"""A gRPC call's messages as the frontend's HTTP /v2 request, and its answer back
(frontend.grpc_api sends them): pure functions, no sockets. A ModelInferRequest becomes the
/infer body with Triton's binary tensor extension (frontend.tensors reads it), the answer's
binary outputs become raw_output_contents, and an HTTP error its gRPC status."""

from __future__ import annotations

from typing import Any, Callable
from urllib.parse import quote

import grpc
import orjson

from frontend import protos, tensors
from frontend.codec import inflate
from frontend.kserve import HEADER_LENGTH
from shmserve.checks import MODEL_NAME_MAX

# An HTTP answer's status as the gRPC status a client gets (Triton's server maps its errors the
# same way): one table.
STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.INVALID_ARGUMENT,  # more texts, or longer ones, than the limits take
    415: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
    507: grpc.StatusCode.RESOURCE_EXHAUSTED,  # the device out of memory for this batch
}


class CallFailed(Exception):
    """An HTTP answer that is an error, as the gRPC status the call ends with."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.metadata = metadata


def model_path(request, sub: str = "", name: str | None = None, version: str | None = None,
               under: str = "/v2") -> str:
    """/v2/models/NAME[/versions/VERSION]SUB for a request naming a model (its `name` and
    `version` fields, or ModelInfer's model_name and model_version); `under` another root
    (/v2/repository)."""
    name = request.name if name is None else name
    version = request.version if version is None else version
    if not name:
        raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, "the model's name is required")
    if len(name) > MODEL_NAME_MAX or len(version) > MODEL_NAME_MAX:
        # as the HTTP route's answer for a name no model has; the path it made was too long
        # for the frontend's HTTP parser: "malformed HTTP request (LineTooLong ...)" (an
        # outside check)
        raise CallFailed(grpc.StatusCode.NOT_FOUND,
                         f"model {name[:200]!r}{'...' * (len(name) > 200)}"
                         + f" version {version[:200]!r}{'...' * (len(version) > 200)}"
                         * bool(version)
                         + f" is not served (names are at most {MODEL_NAME_MAX} characters); "
                         "see GET /v1/models")
    if {".", ".."} & (set(name.split("/")) | set(version.split("/"))):
        # a URL path would resolve it: "../../admin/models" reached GET /admin/models from
        # the frontend itself, past nginx.admin_loopback_only (a version's '/' is escaped, so
        # '../..' there would only be NOT_FOUND: refused alike, one answer for one mistake)
        raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT,
                         f"no model is named {name[:200]!r}" + (
                             f" with version {version[:200]!r}" if version else "")
                         + ": a '.' or '..' between slashes")
    # '/' stays: a model's alias may hold one, as the HTTP routes take it (frontend.kserve)
    path = f"{under}/models/" + quote(name, safe="/")
    if version:
        path += "/versions/" + quote(version, safe="")
    return path + sub


def _parameter(value) -> Any:
    kind = value.WhichOneof("parameter_choice")
    return None if kind is None else getattr(value, kind)


# InferTensorContents' field for each datatype (BYTES is sent as binary data instead).
CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
            "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
            "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
            "FP32": "fp32_contents", "FP64": "fp64_contents"}


def infer_body(request, time_remaining: float | None) -> tuple[bytes, bytes]:
    """A ModelInferRequest as the HTTP /infer body: (JSON header, binary tail). Inputs in
    raw_input_contents, and BYTES inputs in contents, go as binary tensor data; other contents
    as JSON data. Every output comes back binary. The call's deadline is the request's
    `timeout` parameter (microseconds), or lowers the one it gives."""
    parameters = {key: _parameter(value) for key, value in request.parameters.items()}
    given = parameters.get("timeout")
    if time_remaining is not None and (given is None or given == 0 or (
            isinstance(given, int) and not isinstance(given, bool) and given > 0)):
        left_us = max(1, int(time_remaining * 1e6))
        parameters["timeout"] = min(given, left_us) if given else left_us
    parameters["binary_data_output"] = True
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT,
                         f"raw_input_contents holds {len(raw)} tensors for "
                         f"{len(request.inputs)} inputs: give every input's data there, or each "
                         "in its contents")
    inputs, tail = [], []
    for i, tensor in enumerate(request.inputs):
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype,
                                 "shape": list(tensor.shape)}
        entry_params = {key: _parameter(value) for key, value in tensor.parameters.items()}
        if raw:
            data = raw[i]
        elif tensor.datatype == "BYTES":
            data = tensors.bytes_elements(tensor.contents.bytes_contents)
        elif tensor.datatype not in CONTENTS:
            # no contents field of its own (FP16, BF16, a name no datatype has): its
            # bytes_contents as binary data, for the route to judge (JSON holds no bytes)
            data = b"".join(tensor.contents.bytes_contents)
        else:
            data = None
            entry["data"] = list(getattr(tensor.contents, CONTENTS[tensor.datatype]))
        if data is not None:
            entry_params["binary_data_size"] = len(data)
            tail.append(data)
        if entry_params:
            entry["parameters"] = entry_params
        inputs.append(entry)
    header: dict[str, Any] = {"parameters": parameters, "inputs": inputs}
    if request.id:
        header["id"] = request.id
    if request.outputs:
        # Each output's own parameters go too (Triton's `classification`, the shared-memory
        # region), for the route to refuse as over HTTP; the data always comes back binary.
        header["outputs"] = [
            {"name": o.name,
             "parameters": {**{key: _parameter(value) for key, value in o.parameters.items()},
                            "binary_data": True}}
            for o in request.outputs]
    return orjson.dumps(header), b"".join(tail)


def infer_response(headers: dict[str, str], raw: bytes):
    """The HTTP /infer answer (JSON header and binary outputs) as a ModelInferResponse."""
    head, tail = tensors.split_body(raw, headers.get(HEADER_LENGTH))
    at = 0
    outputs, contents = [], []
    for output in head.get("outputs", ()):
        size = output.get("parameters", {}).get("binary_data_size", 0)
        contents.append(tail[at:at + size])
        at += size
        outputs.append(protos.ModelInferResponse.InferOutputTensor(
            name=output["name"], datatype=output["datatype"], shape=output["shape"]))
    return protos.ModelInferResponse(
        model_name=head.get("model_name", ""), model_version=head.get("model_version", ""),
        id=head.get("id", ""), outputs=outputs, raw_output_contents=contents)


def error_text(raw: bytes, status: int) -> str:
    """The message of an HTTP error answer: KServe's {"error": ...} (every /v2 route's), or the
    body as text."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", "replace")[:500] or f"HTTP {status}"
    if isinstance(body, dict):
        found = body.get("error")
        if isinstance(found, dict):  # the other routes' shape
            found = found.get("message")
        if isinstance(found, str):
            return found
    return raw.decode("utf-8", "replace")[:500]


class Undecodable:
    """A request message that did not parse (grpc's own answer to a deserializer's error is
    UNKNOWN, with a traceback in the log): the call's INVALID_ARGUMENT."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
                 ) -> None:
        self.message = message
        self.code = code


# A unary call half-closed without a (whole) request message (frontend.grpc_api._handler).
MISSING = Undecodable("the call ended without a request message (a unary method takes one)")


def parser(message_type, limit: int = -1) -> Callable[[bytes], Any]:
    """`message_type`'s deserializer for grpc: an Undecodable where the bytes do not parse.
    The server runs without grpc's own per-message decompression (frontend.grpc_server): grpc
    inflated a compressed message whole before it checked its size, so 1.9 MB of gzip took a
    frontend to 2.2 GB, before any API key was asked for (an outside check). A compressed
    message reaches here as it was sent and is inflated here, at most `limit` bytes of it (as an
    HTTP body is: frontend.codec.inflate); -1: no limit."""

    def parse(data: bytes):
        try:
            data = inflated(data, limit)
        except ValueError as exc:
            return Undecodable(f"the request message does not inflate ({exc})")
        except OverflowError:
            return Undecodable(f"the request message inflates to more than {limit} bytes "
                               "(nginx.client_max_body_size)", grpc.StatusCode.RESOURCE_EXHAUSTED)
        try:
            return message_type.FromString(data)
        except Exception as exc:  # DecodeError, and what else protobuf's parser raises
            return Undecodable(f"the request is not a valid "
                               f"{message_type.DESCRIPTOR.full_name} message ({exc})")

    return parse


def inflated(data: bytes, limit: int) -> bytes:
    """A message as grpc's per-message compression sent it, inflated: gzip by its magic bytes
    (0x1f opens no protobuf message: wire type 7 does not exist), deflate (zlib) by a valid zlib
    header that then inflates; anything else is the message itself. OverflowError past `limit`
    (-1: none), ValueError for gzip that does not inflate."""
    bound = limit if limit >= 0 else (1 << 62)
    if data[:2] == b"\x1f\x8b":
        out = inflate("gzip", data, bound)
    elif len(data) >= 2 and data[0] & 0x0F == 8 and data[0] >> 4 <= 7 \
            and (data[0] << 8 | data[1]) % 31 == 0:
        try:
            out = inflate("deflate", data, bound)
        except ValueError:
            return data  # a protobuf message that happens to begin like zlib
    else:
        return data
    if len(out) > bound:
        raise OverflowError
    return out
