"""KServe v2 tensors in and out of HTTP bodies: JSON and Triton's binary tensor data extension.

JSON tensor data is read flat or nested, and written flat (row-major), as Triton writes it.

Binary tensor data, both ways. With an ``Inference-Header-Content-Length: N`` header the body is::

    [ N bytes: the JSON header ][ tensor 0 bytes ][ tensor 1 bytes ] ...

where the tensors are those whose entry in the header has ``parameters.binary_data_size``, in
the header's order, each that many bytes: little-endian, row-major, no padding; BOOL is one byte;
a BYTES element is a uint32 little-endian length followed by that many bytes. A response
output is sent that way when its request entry asks ``parameters.binary_data: true``, or when
the request's ``parameters.binary_data_output`` is true and the entry does not say otherwise.

Pure functions, no aiohttp: a malformed body raises `ApiError` (400 for framing, 422 for a
tensor that does not fit its declaration).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from frontend.codec import loads_json
from frontend.errors import ApiError
from frontend.schemas import is_int, whole

# Numeric datatypes of the protocol, as little-endian numpy dtypes. BYTES is handled apart.
DTYPES: dict[str, str] = {
    "BOOL": "?", "UINT8": "<u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
    "INT8": "<i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8",
    "FP16": "<f2", "FP32": "<f4", "FP64": "<f8",
}
BYTES = "BYTES"
# A declared shape's most dimensions, and the largest dimension. The models' tensors have rank 1
# or 2; an unbounded list of 64-bit dimensions made math.prod quadratic in its digits (140,000
# of 2**63 - 1 in a 3 MB body held a frontend's loop past the workers' hung kill, twice, as
# nginx resent the request to the next frontend: an outside check), and a product past 4,300
# digits could not be formatted into the error.
MAX_RANK = 8
MAX_DIM = 2**31 - 1


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray | list[bytes]  # numeric: flat array of the dtype; BYTES: flat list

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def split_body(raw: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes]:
    """The JSON header and the binary tail of a request body."""
    if header_length is None:
        head, tail = raw, b""
    else:
        try:
            n = int(header_length)
        except ValueError:
            n = -1
        if not 0 < n <= len(raw):
            raise ApiError("bad_request", f"Inference-Header-Content-Length is {header_length!r}; "
                           f"it must be a byte count in [1, {len(raw)}] (the body's length)")
        head, tail = raw[:n], raw[n:]
    # The JSON every other route reads (frontend.codec): strict, so NaN, 1e999 and integers
    # past 64 bits are malformed here too, its messages say so without Python's internals, and
    # its arrays are counted first.
    return object_of(loads_json(head, "inference request header"), "the inference request"), tail


def object_of(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ApiError("invalid_request", f"{what} must be an object")
    return value


def read_inputs(header: dict[str, Any], tail: bytes) -> list[Tensor]:
    """Every input of a request, its data from JSON ``data`` or from the binary tail."""
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ApiError("invalid_request", "'inputs' must be a non-empty list", param="inputs")
    tensors, used = [], 0
    for entry in inputs:
        entry = object_of(entry, "each of 'inputs'")
        name, datatype, shape = _declaration(entry)
        params = object_of(_params(entry), f"input {name!r}'s parameters")
        if "shared_memory_region" in params:
            raise ApiError("invalid_request", "the shared-memory extensions are not supported; "
                           "send tensor data in the body", param="inputs")
        size = whole(params.get("binary_data_size"))  # 9.0 is 9, as the schema's integer
        if size is not None:
            if not is_int(size) or size < 0:  # "10" read "'10' does not fit the 10 bytes left"
                shown = orjson.dumps(size, default=repr).decode()
                raise ApiError("bad_request", f"input {name!r}: binary_data_size must be a "
                               f"count of bytes (an integer from 0), not {shown}",
                               param="inputs")
            if used + size > len(tail):
                raise ApiError("bad_request", f"input {name!r}: binary_data_size {size} does "
                               f"not fit the {len(tail) - used} bytes left after the header")
            data = _from_binary(name, datatype, shape, tail[used:used + size])
            used += size
        elif "data" in entry:
            data = _from_json(name, datatype, shape, entry["data"])
        else:
            raise ApiError("invalid_request", f"input {name!r} has neither 'data' nor "
                           "parameters.binary_data_size", param="inputs")
        tensors.append(Tensor(name, datatype, shape, data))
    if used != len(tail):
        raise ApiError("bad_request", f"{len(tail) - used} bytes after the header belong to no "
                       "input (check binary_data_size and Inference-Header-Content-Length)")
    return tensors


# Triton's request parameters: `priority` 1 is the highest level, 0 (or none) the model's
# default; `timeout` in microseconds, 0 (or none) none.
TRITON_TOP_PRIORITY = 10  # what priority 1 is here; 2 is 9, ... down to -10 (the lowest)


def scheduling(header: dict[str, Any]) -> tuple[int | None, float | None]:
    """(priority, timeout in seconds) from the request's Triton parameters, None where not
    given: they were taken and ignored, so a client's priority and timeout did nothing."""
    params = object_of(_params(header), "'parameters'")
    values = []
    for key in ("priority", "timeout"):
        value = whole(params.get(key))
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            what = ("1 the highest level, 0 the default" if key == "priority" else
                    "microseconds, 0 none")
            raise ApiError("invalid_request", f"parameters.{key} must be an integer >= 0 "
                           f"({what})", param="parameters")
        values.append(value or None)
    priority, timeout_us = values
    if timeout_us is not None and timeout_us > 3600 * 10**6:
        raise ApiError("invalid_request", "parameters.timeout must be at most 3,600,000,000 "
                       "microseconds (an hour)", param="parameters")
    return (None if priority is None else max(-10, TRITON_TOP_PRIORITY + 1 - priority),
            None if timeout_us is None else timeout_us / 1e6)


def requested_outputs(header: dict[str, Any], names: list[str]) -> list[tuple[str, bool]]:
    """(output name, as binary) for each output to return, in the request's order."""
    params = object_of(_params(header), "'parameters'")
    default = params.get("binary_data_output", False)
    if not isinstance(default, bool):
        raise ApiError("invalid_request", "parameters.binary_data_output must be a boolean",
                       param="parameters")
    outputs = header.get("outputs")
    if outputs is None or outputs == []:  # none asked for: all (the protocol; Triton's too)
        return [(name, default) for name in names]
    if not isinstance(outputs, list):
        raise ApiError("invalid_request", "'outputs' must be a list", param="outputs")
    wanted = []
    for entry in outputs:
        entry = object_of(entry, "each of 'outputs'")
        name = entry.get("name")
        if not isinstance(name, str):
            raise ApiError("invalid_request", "each of 'outputs' needs a 'name' (a string): "
                           f"one of {', '.join(names)}", param="outputs")
        if name not in names:
            raise ApiError("invalid_request", f"no output {name!r}; this model has "
                           f"{', '.join(names)}", param="outputs")
        if any(name == seen for seen, _ in wanted):  # Triton: "already exists in request"
            raise ApiError("invalid_request", f"output {name!r} is asked for twice",
                           param="outputs")
        out_params = object_of(_params(entry), f"output {name!r}'s parameters")
        if "shared_memory_region" in out_params:
            raise ApiError("invalid_request", "the shared-memory extensions are not supported; "
                           "outputs come back in the body", param="outputs")
        if out_params.get("classification"):
            raise ApiError("invalid_request", "the classification extension is not supported",
                           param="outputs")
        binary = out_params.get("binary_data", default)
        if not isinstance(binary, bool):
            raise ApiError("invalid_request", f"output {name!r}: binary_data must be a boolean",
                           param="outputs")
        wanted.append((name, binary))
    return wanted


def encode_response(head: dict[str, Any], outputs: list[tuple[Tensor, bool]]
                    ) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary tensors follow it."""
    entries, tails = [], []
    for tensor, binary in outputs:
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype,
                                 "shape": list(tensor.shape)}
        if binary:
            raw = raw_bytes(tensor)
            entry["parameters"] = {"binary_data_size": len(raw)}
            tails.append(raw)
        else:
            # A numeric array as it is: orjson writes each float32 as the shortest decimal
            # that reads back as the same float32, as the other JSON routes do (frontend.codec).
            entry["data"] = ([b.decode("utf-8", "replace") for b in tensor.data]
                             if tensor.datatype == BYTES
                             else np.ascontiguousarray(np.ravel(tensor.data)))
        entries.append(entry)
    header = orjson.dumps({**head, "outputs": entries}, option=orjson.OPT_SERIALIZE_NUMPY)
    if not tails:
        return header, None
    return header + b"".join(tails), len(header)


def bytes_elements(items) -> bytes:
    """BYTES elements in the binary extension's layout: each a uint32 little-endian length,
    then its bytes."""
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def raw_bytes(tensor: Tensor) -> bytes:
    """A tensor's data in the binary extension's layout."""
    if tensor.datatype == BYTES:
        return bytes_elements(tensor.data)
    return np.ascontiguousarray(tensor.data, DTYPES[tensor.datatype]).tobytes()


def _declaration(entry: dict[str, Any]) -> tuple[str, str, tuple[int, ...]]:
    name, datatype, shape = entry.get("name"), entry.get("datatype"), entry.get("shape")
    if isinstance(shape, list):
        shape = [whole(d) for d in shape]  # [2.0] is [2], as the OpenAPI document's integer
    if not isinstance(name, str) or not name:
        raise ApiError("invalid_request", "each input needs a 'name'", param="inputs")
    if not isinstance(datatype, str) or datatype != BYTES and datatype not in DTYPES:
        raise ApiError("invalid_request", f"input {name!r}: unknown datatype {datatype!r}",
                       param="inputs")
    if not isinstance(shape, list) or len(shape) > MAX_RANK or \
            not all(is_int(d) and 0 <= d <= MAX_DIM for d in shape):
        raise ApiError("invalid_request", f"input {name!r}: 'shape' must be a list of at most "
                       f"{MAX_RANK} integers from 0 to {MAX_DIM}", param="inputs")
    return name, datatype, tuple(shape)


def _from_binary(name: str, datatype: str, shape: tuple[int, ...],
                 raw: bytes) -> np.ndarray | list[bytes]:
    size = math.prod(shape)
    if datatype != BYTES:
        itemsize = np.dtype(DTYPES[datatype]).itemsize
        if len(raw) != size * itemsize:
            raise ApiError("invalid_request", f"input {name!r}: {len(raw)} bytes for shape "
                           f"{list(shape)} of {datatype} ({size * itemsize} expected)",
                           param="inputs")
        return np.frombuffer(raw, DTYPES[datatype])
    elements, at = [], 0
    while at < len(raw):
        if at + 4 > len(raw) or len(elements) >= size:
            break
        (n,) = struct.unpack_from("<I", raw, at)
        if at + 4 + n > len(raw):
            break
        elements.append(bytes(raw[at + 4:at + 4 + n]))
        at += 4 + n
    if at != len(raw) or len(elements) != size:
        raise ApiError("invalid_request", f"input {name!r}: the BYTES data does not hold "
                       f"{size} length-prefixed elements for shape {list(shape)}",
                       param="inputs")
    return elements


def _from_json(name: str, datatype: str, shape: tuple[int, ...],
               data: Any) -> np.ndarray | list[bytes]:
    flat = _flatten(data)
    if len(flat) != math.prod(shape):
        raise ApiError("invalid_request", f"input {name!r}: {len(flat)} elements for shape "
                       f"{list(shape)}", param="inputs")
    if datatype == BYTES:
        if not all(isinstance(v, (str, bytes)) for v in flat):
            raise ApiError("invalid_request", f"input {name!r}: BYTES data must be strings",
                           param="inputs")
        try:
            return [v.encode("utf-8") if isinstance(v, str) else v for v in flat]
        except UnicodeEncodeError:
            raise ApiError("invalid_request", f"input {name!r}: a string is not valid Unicode",
                           param="inputs") from None
    if not all(isinstance(v, (int, float)) for v in flat):
        raise ApiError("invalid_request", f"input {name!r}: {datatype} data must be numbers",
                       param="inputs")
    try:
        return np.array(flat, DTYPES[datatype])
    except (OverflowError, ValueError, TypeError):
        raise ApiError("invalid_request", f"input {name!r}: a value does not fit {datatype}",
                       param="inputs") from None


def _flatten(data: Any) -> list[Any]:
    """Row-major elements of nested lists (the protocol allows flat or nested data); a loop,
    not recursion, so a deeply nested body cannot exhaust the stack."""
    flat, stack = [], [iter([data])]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def _params(entry: dict[str, Any]) -> Any:
    """An entry's `parameters`: absent or null is none; anything else must be an object
    (object_of), so "", 0 and false are refused as "x" and 1 are."""
    value = entry.get("parameters")
    return {} if value is None else value
