"""Property-based tests of the request decoders and validators: whatever bytes or values arrive,
the result is a value or an ApiError with a 4xx status, never another exception; and the
messages of the malformed bodies users send, which must say what is wrong."""

import gzip
import json
import time
import zlib

import brotli
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend import codec
from frontend.codec import decode_body
from frontend.errors import ApiError
from frontend.schemas import parse_openai_embeddings, parse_predict, parse_priority
from shmserve.config import LimitsConfig

LIMITS = LimitsConfig(max_texts_per_request=8, max_text_chars=50, truncate=True)
CTYPES = st.sampled_from(["application/json", "application/msgpack", "application/x-msgpack",
                          "text/plain", "application/octet-stream"])
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**63, max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=5),
    max_leaves=30)


def decodes_or_4xx(raw: bytes, ctype: str, has_type: bool = True):
    try:
        return decode_body(raw, ctype, has_type)
    except ApiError as exc:
        assert 400 <= exc.status < 500
        return None


@SETTINGS
@given(raw=st.binary(max_size=512), ctype=CTYPES, has_type=st.booleans())
def test_arbitrary_bytes(raw, ctype, has_type):
    decodes_or_4xx(raw, ctype, has_type)


@SETTINGS
@given(value=json_values)
def test_valid_encodings_round_trip(value):
    assert decode_body(json.dumps(value).encode(), "application/json") == value
    assert decode_body(msgpack.packb(value), "application/msgpack") == value
    assert decode_body(msgpack.packb(value), "application/vnd.msgpack") == value  # IANA's


@SETTINGS
@given(value=json_values, cut=st.integers(min_value=0, max_value=64))
def test_truncated_bodies(value, cut):
    for raw, ctype in ((json.dumps(value).encode(), "application/json"),
                       (msgpack.packb(value), "application/msgpack")):
        decodes_or_4xx(raw[:max(0, len(raw) - cut)], ctype)


body_values = st.one_of(
    json_values,
    st.fixed_dictionaries({"texts": json_values}, optional={"model": json_values,
                                                             "priority": json_values}),
    st.fixed_dictionaries({"input": json_values},
                          optional={"model": json_values, "encoding_format": json_values,
                                    "priority": json_values, "user": json_values}),
    st.fixed_dictionaries({"texts": st.lists(st.text(max_size=60), max_size=10)}),
    st.fixed_dictionaries({"input": st.lists(st.text(max_size=60), max_size=10)}),
)


@SETTINGS
@given(body=body_values)
def test_validators_accept_or_refuse_with_4xx(body):
    for parse in (parse_predict, parse_openai_embeddings):
        try:
            req = parse(body, LIMITS)
        except ApiError as exc:
            assert exc.status in (413, 422)
            continue
        if req.token_ids is not None:  # OpenAI's pre-tokenized input: texts stay empty
            assert req.texts == []
            assert 1 <= len(req.token_ids) <= LIMITS.max_texts_per_request
            assert all(row and all(type(i) is int for i in row) for row in req.token_ids)
            continue
        assert 1 <= len(req.texts) <= LIMITS.max_texts_per_request
        assert all(isinstance(t, str) and 0 < len(t) <= LIMITS.max_text_chars
                   for t in req.texts)


@SETTINGS
@given(value=json_values)
def test_priority_values(value):
    try:
        level = parse_priority(value, "priority")
    except ApiError as exc:
        assert exc.status == 422
    else:
        assert -10 <= level <= 10


@pytest.mark.parametrize("raw,ctype,detail", [
    # msgpack's C unpacker raises these two with an empty message.
    (b"\xc1", "application/msgpack",
     "a type byte msgpack does not define, such as 0xc1 (FormatError)"),
    (b"\x91" * 2000 + b"\x01", "application/msgpack", "nested too deeply (StackError)"),
    (b"\x92\x01", "application/msgpack", "Unpack failed: incomplete input"),
    (b"\x91\xd4\x01\x00", "application/msgpack", "msgpack extension type 1 (none is accepted)"),
    # orjson says "surrogates not allowed" about any invalid UTF-8.
    (b'{"texts": ["\xff"]}', "application/json",
     "the body is not valid UTF-8 (byte 12: invalid start byte)"),
    (b'{"texts": ["\xed\xa0\x80"]}', "application/json", "the body is not valid UTF-8 (byte 12"),
    (b'{"texts": [', "application/json", "unexpected end of data"),
    # Python's json.dumps writes these by default; orjson's message named neither
    (b'{"texts": ["a"], "x": NaN}', "application/json",
     "unexpected character, expected a JSON value: line 1 column 23 (char 22) (NaN and "
     "Infinity are not JSON: send finite numbers)"),
    (b'{"texts": ["\xc3\xa9"], "x": -Infinity}', "application/json",
     "no digit after sign: line 1 column 24 (char 23) (NaN and Infinity are not JSON"),
])
def test_malformed_bodies_say_what_is_wrong(raw, ctype, detail):
    with pytest.raises(ApiError) as info:
        decode_body(raw, ctype)
    assert info.value.status == 400
    message = info.value.message
    assert message.split(": ", 1)[1].startswith(detail), message
    assert "surrogates" not in message


@pytest.mark.parametrize("container", [b"\x90", b"\x80"])  # empty array, empty map
def test_a_msgpack_body_of_countless_containers_is_refused_as_they_are_built(container):
    """8 MB of empty arrays (a byte each, ~60 bytes each in Python) held a frontend's loop for
    2 s and 600 MB before the request was refused for having too many inputs."""
    n = 8 << 20
    with pytest.raises(ApiError) as info:
        decode_body(b"\x81\xa5input\xdd" + n.to_bytes(4, "big") + container * n,
                    "application/msgpack")
    assert info.value.status == 400
    assert "more than 131,072 arrays and maps" in info.value.message
    at_limit = msgpack.packb({"input": [[1]] * (codec.MAX_CONTAINERS - 2)})
    assert len(decode_body(at_limit, "application/msgpack")["input"]) == 131_070


def test_a_json_body_of_countless_containers_is_refused_before_it_is_parsed():
    """8 MB of `{}` (gzip: 8 KB) took a frontend ~200 MB a request, 1-2 GB each under 24-64
    such clients (an outside check): counted before parsing, as msgpack's are as built.
    Brackets inside strings, escaped quotes and backslashes among them, do not count."""
    limit = codec.MAX_CONTAINERS
    bomb = b'{"texts": ["a"], "pad": [' + b"{}," * limit + b"{}]}"
    with pytest.raises(ApiError) as info:
        decode_body(bomb, "application/json")
    assert info.value.status == 400
    assert "more than 131,072 arrays and objects" in info.value.message
    at_limit = json.dumps({"input": [[1]] * (limit - 2)}).encode()
    assert len(decode_body(at_limit, "application/json")["input"]) == limit - 2
    for text in ("[{" * limit, '\\"[' * limit, "\\\\" + "[" * limit, '"' + "{" * limit):
        body = json.dumps({"texts": [text, "[[", '\\"', "x"]}).encode()
        assert codec.json_containers(body) in (0, 2), text[:8]
        assert decode_body(body, "application/json")["texts"][0] == text


@pytest.mark.parametrize("coding,pack", [
    ("gzip", gzip.compress), ("x-gzip", gzip.compress), ("deflate", zlib.compress),
    ("deflate", lambda b: zlib.compress(b, wbits=-zlib.MAX_WBITS)),  # raw, as some clients send
    ("br", brotli.compress),
])
def test_request_bodies_inflate_within_the_limit(coding, pack):
    body = b'{"input": "' + b"x" * 5000 + b'"}'
    assert codec.inflate(coding, pack(body), 10_000) == body
    # A bomb stops one byte past the limit, without inflating the rest.
    assert len(codec.inflate(coding, pack(b"0" * 10_000_000), 10_000)) == 10_001
    with pytest.raises(ValueError, match="ends early"):
        codec.inflate(coding, pack(body)[:-8], 10_000)
    with pytest.raises(ValueError):
        codec.inflate(coding, b"not compressed at all", 10_000)


@pytest.mark.parametrize("accept,packed", [
    ("application/msgpack", True), ("Application/MsgPack", True),  # media types ignore case
    ("application/vnd.msgpack", True), ("application/x-msgpack, */*;q=0.1", True),
    ("application/msgpack, */*", True),  # named beats a wildcard at the same q
    ("application/msgpack;q=0.5, application/json;q=0.4", True),
    ("", False), ("*/*", False), ("application/json", False),
    ("application/json, application/msgpack;q=0.1", False),  # q values count
    ("application/msgpack;q=0", False), ("application/msgpack; Q=0.000", False),  # refused
    ("application/json, application/msgpack", False),  # a tie keeps JSON
    ("application/msgpack;q=high", False), ("application/msgpackx", False),
    ("text/html, application/msgpack;q=0.2", True),
    # a q that is no RFC 9110 qvalue is not acceptable, as nginx's error pages read it: "nan"
    # was JSON from a frontend by NaN's comparisons and msgpack from nginx (an outside check)
    ("application/msgpack;q=nan", False), ("application/msgpack;q=2", False),
    ("application/msgpack;q=0.1234", False), ("application/msgpack;q=1.", True),
    ("application/msgpack;q=0.5;ext=1", True),
])
def test_accept_is_negotiated_with_q_values(accept, packed):
    from frontend.codec import prefers_msgpack

    assert prefers_msgpack(accept) is packed


def test_gzip_members_one_after_another_are_one_body_and_nothing_else_may_follow():
    """RFC 1952: a gzip file may hold several members (`cat a.gz b.gz`); only the first was
    read, and junk after a stream was ignored (an outside check)."""
    body = b'{"input": "' + b"x" * 5000 + b'"}'
    members = gzip.compress(body[:7]) + gzip.compress(body[7:100]) + gzip.compress(body[100:])
    assert codec.inflate("gzip", members, 10_000) == body
    bomb = gzip.compress(b"0" * 6000) + gzip.compress(b"0" * 10_000_000)
    assert len(codec.inflate("gzip", bomb, 10_000)) == 10_001  # the limit holds across members
    with pytest.raises(ValueError, match="not gzip"):
        codec.inflate("gzip", gzip.compress(body) + b"junk", 10_000)
    # zero padding after the last member (a tape block's), as gzip itself ignores it
    assert codec.inflate("gzip", gzip.compress(body) + b"\0" * 512, 10_000) == body
    with pytest.raises(ValueError, match="ends early"):
        codec.inflate("gzip", gzip.compress(body) + gzip.compress(body)[:-8], 100_000)
    with pytest.raises(ValueError, match="after the end"):
        codec.inflate("deflate", zlib.compress(body) + b"junk", 10_000)


def test_a_body_of_many_gzip_members_is_refused_in_time():
    """Each member's end copies the rest of the body: 410,000 empty members in 8 MB held a
    frontend's event loop until the workers killed it as hung, and nginx sent the body on to
    the next frontend (a security review)."""
    body = gzip.compress(b'{"input": "x"}')
    assert codec.inflate("gzip", body * codec.GZIP_MEMBERS, 10_000) == \
        b'{"input": "x"}' * codec.GZIP_MEMBERS
    many = body + gzip.compress(b"") * 400_000  # 8 MB
    started = time.perf_counter()
    with pytest.raises(ValueError, match=f"more than {codec.GZIP_MEMBERS} gzip members"):
        codec.inflate("gzip", many, 8 << 20)
    assert time.perf_counter() - started < 2  # minutes before


def test_a_415_names_the_content_type_as_sent():
    # aiohttp reads an unparseable type as application/octet-stream; the client sent this.
    with pytest.raises(ApiError) as info:
        decode_body(b"{}", "application/octet-stream", True, "junk;;;")
    assert info.value.status == 415 and "'junk;;;'" in info.value.message
    with pytest.raises(ApiError) as info:
        decode_body(b"{}", "text/plain", True, "text/plain; " + "x" * 5000)
    assert len(info.value.message) < 300


@pytest.mark.parametrize("charset", ["latin-1", "ISO-8859-1", '"windows-1252"', "utf-16",
                                     "UTF-8", "utf8"])
def test_a_json_body_is_read_in_the_charset_its_content_type_names(charset):
    text = "café naïve Å"
    name = charset.strip('"')
    raw = json.dumps({"texts": [text]}, ensure_ascii=False).encode(name)
    sent = f"application/json; charset={charset}"
    assert decode_body(raw, "application/json", True, sent) == {"texts": [text]}
    # and with its parameters in any order, spaced any way
    assert decode_body(raw, "application/json", True,
                       f"application/json ;foo=bar;  charset = {charset} ") == {"texts": [text]}


def test_a_charset_not_read_is_415_and_bytes_not_of_it_are_400():
    for charset, status, says in (("x-no-such", 415, "charset 'x-no-such' is not one"),
                                  ("base64", 415, "charset 'base64' is not one"),
                                  ("ascii", 400, "not valid ascii (its Content-Type's charset) "
                                                 "at byte 12")):
        with pytest.raises(ApiError) as info:
            decode_body('{"texts": ["é"]}'.encode("latin-1"), "application/json", True,
                        f"application/json; charset={charset}")
        assert info.value.status == status and says in info.value.message, info.value.message
    # No charset, or UTF-8's: the bytes as sent (invalid UTF-8 still says so)
    with pytest.raises(ApiError) as info:
        decode_body('{"texts": ["é"]}'.encode("latin-1"), "application/json", True,
                    "application/json")
    assert "not valid UTF-8" in info.value.message


@pytest.mark.parametrize("raw", [b'{"input":' + b"[" * 1000, b"[" * 1000])
def test_a_body_ending_inside_open_arrays_says_so_not_out_of_memory(raw):
    with pytest.raises(ApiError) as caught:
        decode_body(raw, "application/json", True)
    assert caught.value.status == 400
    assert "unclosed arrays or objects" in str(caught.value.message)
    assert "memory" not in str(caught.value.message)


def test_large_bodies_are_decoded_and_inflated_off_the_event_loop():
    """Fifty 8 MB bodies (12 KB of gzip each) sent at once were inflated and decoded one after
    another on the event loop before any timer ran: probes and the frontend's pings waited
    (an outside check). A body of OFF_LOOP_BYTES or more decodes on a thread, a small one
    inline (a thread hop costs more than it)."""
    import asyncio
    import threading

    from frontend import codec

    async def threads():
        small = await codec.decoded(b"x" * (codec.OFF_LOOP_BYTES - 1), threading.get_ident)
        large = await codec.decoded(b"x" * codec.OFF_LOOP_BYTES, threading.get_ident)
        return threading.get_ident(), small, large

    loop_thread, small, large = asyncio.run(threads())
    assert small == loop_thread != large
