"""schemathesis' msgpack: request bodies as every POST route takes them, and answers read back for
the document's schemas. Imported by tests/e2e/test_openapi.py and, as SCHEMATHESIS_HOOKS, by the
schemathesis command it runs."""

import msgpack
import schemathesis


@schemathesis.serializer("application/msgpack")
def _msgpack(ctx, value):
    # Every POST route takes msgpack too: fuzz it like JSON. msgpack has no integers past 64
    # bits, so a msgpack client can only send those as floats.
    return {"data": msgpack.packb(_floats(value), use_bin_type=True)}


@schemathesis.deserializer("application/msgpack")
def _read_msgpack(ctx, response):
    # A vector in msgpack is its float32 bytes, which the document's schemas give as a string
    # (`Vector`): validated as one.
    return _strings(msgpack.unpackb(response.content, raw=False, strict_map_key=False))


def _floats(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and not -(1 << 63) <= value < (1 << 64):
        return float(value)
    if isinstance(value, list):
        return [_floats(v) for v in value]
    if isinstance(value, dict):
        return {k: _floats(v) for k, v in value.items()}
    return value


def _strings(value):
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [_strings(v) for v in value]
    if isinstance(value, dict):
        return {k: _strings(v) for k, v in value.items()}
    return value
