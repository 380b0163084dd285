"""Request bodies in, response bodies out: JSON or msgpack, negotiated per request.

Requests: by Content-Type (``application/json``; ``application/msgpack``,
``application/vnd.msgpack`` (IANA's) or ``application/x-msgpack``); a missing Content-Type is
read as JSON. Responses: msgpack when the Accept header prefers a msgpack type to JSON (see
`prefers_msgpack`), JSON otherwise. In msgpack responses, float vectors are raw little-endian
float32 bytes (``bin``), one per vector: `np.frombuffer(b, "<f4")` reads them.
"""

from __future__ import annotations

import asyncio
import functools
import re
import zlib
from typing import Any, Callable

import msgpack
import numpy as np
import orjson
from aiohttp import web

from frontend.errors import ApiError

JSON = "application/json"
MSGPACK = "application/msgpack"
MSGPACK_TYPES = ("application/msgpack", "application/vnd.msgpack", "application/x-msgpack")
# The media ranges JSON answers, most specific first (RFC 9110 12.5.1: the most specific range
# that matches gives a type its quality).
JSON_RANGES = (JSON, "application/*", "*/*")


def wants_msgpack(request: web.Request) -> bool:
    return prefers_msgpack(request.headers.get("Accept", ""))


QVALUE = re.compile(r"0(\.[0-9]{0,3})?|1(\.0{0,3})?")  # RFC 9110, 12.4.2


@functools.lru_cache(maxsize=256)  # a client sends the same Accept on every request
def prefers_msgpack(accept: str) -> bool:
    """Whether an Accept header prefers msgpack to JSON: media types compared case-insensitively,
    each with its q value (1 when absent; q=0 is "not acceptable", and so is a q that is not
    RFC 9110's qvalue: "high", "nan", "2", as nginx's error pages read it). msgpack must be named (a
    wildcard is answered with JSON); it wins over a higher q for JSON, and over an equal one only
    when JSON is matched by a wildcard alone (`application/msgpack, */*`). Ties with a named
    application/json, and anything unreadable, keep JSON, the default."""
    ranges: dict[str, float] = {}
    for item in accept.lower().split(","):
        media, *params = (p.strip() for p in item.split(";"))
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "q":
                q = float(value) if QVALUE.fullmatch(value := value.strip()) else 0.0
        if media:
            ranges[media] = max(q, ranges.get(media, 0.0))
    packed = max((ranges.get(t, 0.0) for t in MSGPACK_TYPES), default=0.0)
    matched = next((r for r in JSON_RANGES if r in ranges), None)
    plain = ranges[matched] if matched else 0.0
    return packed > plain or (packed > 0 and packed == plain and matched != JSON)


# The "model" a request's body names, as sent: a request refused before its model is resolved
# (a bad field) is still counted under that model when it is a served one (frontend.app).
NAMED_MODEL = web.RequestKey("named_model", str)


def media_type(request: web.BaseRequest) -> str:
    """The request's media type, lowercased and without its parameters (charset, ...);
    application/octet-stream when none is sent, as aiohttp's own property says. Not that
    property: it parses every parameter with the email package, ~0.9 s of a frontend's event
    loop for a 15 KB header of 1,900 parameters (an outside check: 16 such requests held both
    frontends for 9 s and failed a readiness probe)."""
    return request.headers.get("Content-Type", "").partition(";")[0].strip().lower() or \
        "application/octet-stream"


# A body this large (bytes, inflated) is decoded on a thread: in the event loop, fifty 8 MB
# bodies sent at once were decoded one after another before any timer ran, and a frontend's
# pings and probes waited seconds behind them (an outside check).
OFF_LOOP_BYTES = 1 << 18


async def decoded(raw: bytes, decode: Callable[..., Any], *args: Any,
                  off_loop_bytes: int = OFF_LOOP_BYTES) -> Any:
    """`decode(*args)`, for a body of `raw`: on a thread when it is `off_loop_bytes` or more."""
    if len(raw) < off_loop_bytes:
        return decode(*args)
    return await asyncio.get_running_loop().run_in_executor(None, decode, *args)


async def read_body(request: web.Request) -> Any:
    # A missing (or empty) Content-Type reads as application/octet-stream; tell them apart from
    # a client that sent that type. An empty header is taken as no header.
    sent = request.headers.get("Content-Type", "").strip()
    raw = await read_raw(request)
    body = await decoded(raw, decode_body, raw, media_type(request), bool(sent), sent)
    if isinstance(body, dict) and isinstance(name := body.get("model"), str):
        request[NAMED_MODEL] = name
    return body


async def read_raw(request: web.Request) -> bytes:
    """The body's bytes, inflated here per its Content-Encoding (the frontends run aiohttp with
    auto_decompress off: its parser answered some bodies that do not inflate with a plain-text
    400 before any handler, others with a 500). Not inflatable: 400; inflating past the body
    limit: 413; a coding other than gzip, deflate or br: 415 (nginx refuses those first)."""
    raw = await request.read()
    # Lines given twice are one list (RFC 9110), as nginx's 415 takes "gzip, gzip": the first
    # line alone was read, so a second coding went unapplied, or unseen (an outside check).
    encoding = ", ".join(request.headers.getall("Content-Encoding", ())).strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in CODINGS:
        raise ApiError("unsupported_media_type", "Content-Encoding must be gzip, deflate, br or "
                       "identity")
    limit = request.client_max_size
    try:  # on a thread past a few KB, which may inflate to megabytes
        body = await decoded(raw, inflate, encoding, raw, limit,
                             off_loop_bytes=INFLATE_OFF_LOOP_BYTES)
    except ValueError as exc:
        raise ApiError("bad_request", f"the body does not decode as its Content-Encoding "
                       f"({encoding}): {exc}") from None
    if len(body) > limit:
        raise ApiError("too_large", f"the body inflates to more than {limit} bytes "
                       "(nginx.client_max_body_size)")
    return body


CODINGS = ("gzip", "x-gzip", "deflate", "br")
INFLATE_OFF_LOOP_BYTES = 4096  # a compressed body this large is inflated on a thread


GZIP_MEMBERS = 64  # gzip members in one body (`cat a.gz b.gz` makes two)


def inflate(encoding: str, raw: bytes, limit: int) -> bytes:
    """`raw` decoded, at most `limit` + 1 bytes of it (enough to tell it is too large);
    ValueError when it is not whole, valid data of that coding."""
    if encoding == "br":
        import brotli

        decoder = brotli.Decompressor()
        try:
            out = decoder.process(raw, output_buffer_limit=limit + 1)
        except brotli.error as exc:
            raise ValueError("not brotli data") from exc
        if len(out) <= limit and not decoder.is_finished():
            raise ValueError("the data ends early")
        return out[:limit + 1]  # the buffer limit is approximate (a block)
    # gzip; deflate is the zlib format (RFC 9110), or raw deflate as some clients send it.
    for wbits in ((16 + zlib.MAX_WBITS,) if encoding != "deflate" else (zlib.MAX_WBITS,
                                                                          -zlib.MAX_WBITS)):
        decoder = zlib.decompressobj(wbits)
        try:
            out = decoder.decompress(raw, limit + 1)
        except zlib.error as exc:
            error = exc
            continue
        if len(out) <= limit and not decoder.eof:
            raise ValueError("the data ends early")
        # gzip members one after another are one body (RFC 1952, as `cat a.gz b.gz`); after
        # the last, or after a zlib stream, nothing may follow but zero bytes (block padding,
        # which gzip itself ignores). At most GZIP_MEMBERS: each member's end copies the rest
        # of the body, so 410,000 empty members in 8 MB held the event loop for minutes.
        members = 1
        while len(out) <= limit and decoder.unused_data.strip(b"\0"):
            if wbits != 16 + zlib.MAX_WBITS:
                raise ValueError("data after the end of the compressed stream")
            members += 1
            if members > GZIP_MEMBERS:
                raise ValueError(f"more than {GZIP_MEMBERS} gzip members")
            rest, decoder = decoder.unused_data, zlib.decompressobj(wbits)
            try:
                out += decoder.decompress(rest, limit + 1 - len(out))
            except zlib.error:
                raise ValueError("data after the end of the gzip stream is not gzip") from None
            if len(out) <= limit and not decoder.eof:
                raise ValueError("the data ends early")
        return out
    raise ValueError(str(error).removeprefix("Error -3 while decompressing data: "))


def decode_body(raw: bytes, ctype: str, has_type: bool = True, sent: str = "") -> Any:
    """Bytes to a Python value, or ApiError (400 or 415): never any other exception. `sent`:
    the Content-Type header as the client wrote it, for the 415's message (aiohttp reads a type
    it cannot parse, `junk;;;`, as application/octet-stream)."""
    if not raw:
        raise ApiError("bad_request", "empty request body")
    if ctype in MSGPACK_TYPES:
        try:
            return _unpack(raw)
        except _Containers:
            raise ApiError("bad_request", f"the msgpack body holds more than "
                           f"{MAX_CONTAINERS:,} arrays and maps; no request needs as "
                           "many") from None
        except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError,
                TypeError) as exc:
            raise ApiError("bad_request", f"malformed msgpack body: {_msgpack_detail(exc)}"
                           ) from None
    if ctype == JSON or not has_type:
        return loads_json(as_utf8(raw, sent), "JSON body")
    # a byte that is not UTF-8 as the byte (\xff), not Python's surrogate (\udcff)
    sent = sent.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    named = sent if len(sent) <= 100 else sent[:100] + "..."
    raise ApiError("unsupported_media_type",
                   f"Content-Type '{named or ctype}' is not supported; send {JSON} or {MSGPACK}")


def as_utf8(raw: bytes, sent: str) -> bytes:
    """A JSON body in UTF-8: as sent, unless its Content-Type names another charset
    (`application/json; charset=latin-1`, as some HTTP clients still send), which it is
    decoded from. RFC 8259 asks for UTF-8 and defines no charset parameter; read as UTF-8
    regardless, such a body's accented letters were refused as invalid UTF-8, or, where the
    bytes happened to be valid UTF-8, embedded as other letters. A charset Python does not
    know: 415; bytes that are not of the charset named: 400."""
    if ";" not in sent:
        return raw
    charset = ""
    for param in sent.split(";")[1:]:
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset":
            charset = value.strip().strip('"').lower()
    if charset in ("", "utf-8", "utf8"):
        return raw
    try:
        return raw.decode(charset).encode("utf-8")
    except LookupError:  # no such charset, or a bytes-to-bytes codec (base64, zlib)
        named = charset if len(charset) <= 40 else charset[:40] + "..."
        raise ApiError("unsupported_media_type", f"charset {named!r} is not one this server "
                       "reads; send JSON in UTF-8 (RFC 8259)") from None
    except UnicodeError as exc:
        raise ApiError("bad_request", f"the body is not valid {charset} (its Content-Type's "
                       f"charset) at byte {getattr(exc, 'start', 0)}") from None


# The most arrays and maps (objects) a msgpack or JSON body may hold. An empty one is one byte of
# msgpack and ~60 of Python: 8 MB of them held a frontend's loop for 2 s and raised its memory by
# 600 MB before the request was refused for its size (an outside check). A request at the limits
# holds a few hundred (256 texts' token ids, or KServe's nested data).
MAX_CONTAINERS = 1 << 17
UTF8_BOM = b"\xef\xbb\xbf"


def loads_json(raw: bytes, what: str) -> Any:
    """JSON to Python, or a 400 naming `what`: its arrays and objects counted first
    (MAX_CONTAINERS); orjson is strict JSON: NaN and Infinity, invalid UTF-8, integers past 64
    bits and nesting deeper than 1024 are all JSONDecodeError. Every JSON a client sends is
    read here (KServe's inference header read it itself, without the count: 8 MB of `[]`, from
    8 KB of gzip, held a frontend's event loop ~1.5 s and ~210 MB each, and twenty at once got
    both frontends killed as hung, an outside check)."""
    if json_containers(raw) > MAX_CONTAINERS:
        raise ApiError("bad_request", f"the {what} holds more than {MAX_CONTAINERS:,} arrays "
                       "and objects; no request needs as many")
    if raw.startswith(UTF8_BOM):  # which RFC 8259 lets a parser ignore, and orjson refused:
        raw = raw[len(UTF8_BOM):]  # files saved by Windows editors begin with one
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError("bad_request", f"malformed {what}: {json_detail(exc, raw)}") from None


def json_containers(raw: bytes) -> int:
    """How many arrays and objects a JSON body opens, counted before it is parsed: as with
    msgpack, 8 MB of `{}` (an empty dict is ~64 bytes of Python) took a frontend ~200 MB each
    (an outside check). A body with fewer brackets than the limit, anywhere, is not scanned
    further; else the brackets inside strings are left out (escaped backslashes and quotes
    dropped, then a quote's parity says whether a byte is inside a string): linear, at numpy's
    speed. On a body that is not JSON the count means nothing, and orjson refuses it after."""
    if raw.count(b"{") + raw.count(b"[") <= MAX_CONTAINERS:
        return 0
    plain = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    inside = np.bitwise_xor.accumulate(plain == ord('"'))
    return int(np.count_nonzero(((plain == ord("{")) | (plain == ord("["))) & ~inside))


class _Containers(Exception):
    pass


def _unpack(raw: bytes) -> Any:
    """msgpack to Python, counting containers as they are built (MAX_CONTAINERS), and
    refusing extension types (none is ever accepted) before building them. Map keys are
    strict: str or bytes only."""
    built = 0

    def counted(container):
        nonlocal built
        built += 1
        if built > MAX_CONTAINERS:
            raise _Containers
        return container

    return msgpack.unpackb(raw, raw=False, list_hook=counted, object_hook=counted,
                           ext_hook=_no_extension)


def _no_extension(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} (none is accepted)")


# What msgpack's C unpacker means by the two exceptions it raises with no message at all.
_SILENT = {msgpack.FormatError: "a type byte msgpack does not define, such as 0xc1",
           msgpack.StackError: "nested too deeply"}


def _msgpack_detail(exc: Exception) -> str:
    if str(exc):
        return str(exc)
    name = type(exc).__name__
    return f"{_SILENT[type(exc)]} ({name})" if type(exc) in _SILENT else name


def json_detail(exc: orjson.JSONDecodeError, raw: bytes) -> str:
    # orjson reports invalid UTF-8 anywhere in the body as "str is not valid UTF-8: surrogates
    # not allowed" at line 1 column 1, which names neither the problem nor the place.
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        return f"the body is not valid UTF-8 (byte {bad.start}: {bad.reason})"
    # orjson's parser says "failed to allocate memory" for a body that ends inside hundreds of
    # open arrays or objects ('{"input":' and 1,000 '['): no memory ran out (an outside check).
    detail = str(exc).replace("failed to allocate memory",
                              "the body ends inside unclosed arrays or objects", 1)
    # NaN and Infinity (Python's json.dumps writes them by default) read as "unexpected
    # character", which does not name them (an outside check)
    if raw.decode("utf-8")[exc.pos:exc.pos + 8].startswith(("NaN", "Infinity")):
        detail += " (NaN and Infinity are not JSON: send finite numbers)"
    return detail


def render(request: web.Request, body: dict[str, Any], status: int = 200,
           headers: dict[str, str] | None = None) -> web.Response:
    if wants_msgpack(request):
        return web.Response(body=msgpack.packb(body, use_bin_type=True, default=_numpy_default),
                            status=status, content_type=MSGPACK, headers=headers)
    return web.Response(body=orjson.dumps(body, default=_numpy_default,
                                          option=orjson.OPT_SERIALIZE_NUMPY),
                        status=status, content_type=JSON, headers=headers)


def vectors(array: np.ndarray, as_msgpack: bool) -> list[Any]:
    """Rows of a float32 matrix: raw LE float32 bytes for msgpack; for JSON, float32 rows that
    orjson writes as the shortest decimal that reads back as the same float32."""
    data = np.ascontiguousarray(array, dtype="<f4")
    if as_msgpack:
        return [row.tobytes() for row in data]
    return list(data)


def _numpy_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot encode {type(value).__name__}")
