"""The wire format: the only code that knows the frame layout or uses msgpack for IPC.

    frame 0   one byte: protocol.Kind
    frame 1   msgpack array of the message's fields, in declaration order; a nested
              dataclass is itself an array, tuples travel as arrays, IntEnums as ints

A worker sends the replies a batch finished for one frontend as one ZeroMQ message of several
such pairs (`decode_all`): one send and one wake-up per batch and frontend, not per request.

A ROUTER socket prepends the peer identity frame; callers strip it before `decode`. Tensor bytes
never travel here: messages carry `ShmHandle`s into a shared-memory arena.
"""

from __future__ import annotations

import dataclasses
import threading
import typing
from enum import IntEnum
from typing import Any, Callable

import msgpack

from shmserve.protocol import KIND_OF, Kind, Message


class WireError(ValueError):
    """Frames that are not a message of this protocol."""


def encode(msg: Message) -> list[bytes]:
    packer = getattr(_local, "packer", None)
    if packer is None:  # one per thread: a Packer's buffer is not safe to share
        packer = _local.packer = msgpack.Packer(default=_fields_of, use_bin_type=True)
    return [_KIND_FRAMES[type(msg)], packer.pack(msg)]


def decode(frames: list[bytes] | list[Any]) -> Message:
    if len(frames) != 2:
        raise WireError(f"expected 2 frames, got {len(frames)}")
    head, body = bytes(frames[0]), bytes(frames[1])
    if len(head) != 1:
        raise WireError("the kind frame must be one byte")
    try:
        build = _BUILDERS[Kind(head[0])]
    except ValueError:
        raise WireError(f"unknown message kind {head[0]}") from None
    try:
        return build(msgpack.unpackb(body, raw=False, use_list=True))
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise WireError(f"bad {Kind(head[0]).name} body: {exc}") from None


def decode_all(frames: list[bytes] | list[Any]) -> list[Message | WireError]:
    """Every message of a multi-message frame list ((kind, body) pairs), in order; a pair that
    does not decode is its WireError in place, so one bad reply loses no other."""
    if not frames or len(frames) % 2:
        raise WireError(f"expected (kind, body) pairs, got {len(frames)} frames")
    out: list[Message | WireError] = []
    for i in range(0, len(frames), 2):
        try:
            out.append(decode(frames[i:i + 2]))
        except WireError as exc:
            out.append(exc)
    return out


def _fields_of(value: Any) -> list[Any]:
    """msgpack's hook for what it cannot pack itself: a message dataclass, as its field list.
    (Tuples pack as arrays, IntEnums as ints, natively.)"""
    names = _FIELD_NAMES.get(type(value))
    if names is None:
        raise TypeError(f"cannot send {type(value).__name__}")
    return [getattr(value, n) for n in names]


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _builder(hint: Any) -> Callable[[Any], Any]:
    """A function that rebuilds a value of type `hint` from its wire form."""
    if dataclasses.is_dataclass(hint):
        names = [f.name for f in dataclasses.fields(hint)]
        _FIELD_NAMES[hint] = tuple(names)  # what encode sends: every dataclass reachable here
        hints = typing.get_type_hints(hint)
        parts = [_builder(hints[n]) for n in names]

        def build(raw: Any) -> Any:
            if not isinstance(raw, list) or len(raw) != len(parts):
                raise ValueError(f"{hint.__name__} needs {len(parts)} fields")
            return hint(*(p(v) for p, v in zip(parts, raw)))

        return build
    origin = typing.get_origin(hint)
    if origin is tuple:
        item = _builder(typing.get_args(hint)[0])
        return lambda raw: tuple(item(v) for v in raw)
    if isinstance(hint, type) and issubclass(hint, IntEnum):
        return hint
    if hint in (int, float, str, bool):
        def check(raw: Any, hint: type = hint) -> Any:
            if hint is float and isinstance(raw, int) and not isinstance(raw, bool):
                return float(raw)
            if not isinstance(raw, hint) or (hint is int and isinstance(raw, bool)):
                raise TypeError(f"expected {hint.__name__}, got {type(raw).__name__}")
            return raw

        return check
    raise TypeError(f"no wire form for {hint!r}")


_BUILDERS: dict[Kind, Callable[[Any], Message]] = {
    kind: _builder(cls) for cls, kind in KIND_OF.items()
}
_KIND_FRAMES = {cls: bytes((kind,)) for cls, kind in KIND_OF.items()}
_local = threading.local()
