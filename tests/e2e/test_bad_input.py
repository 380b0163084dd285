"""Broken input through nginx: always a 4xx with an error body, never a 5xx, no restarts."""

import gzip
import json
import zlib

import brotli
import msgpack
import pytest

JSON = {"Content-Type": "application/json"}


def pids(stack) -> dict[str, str]:
    """program -> 'RUNNING pid N,' from supervisorctl status."""
    return {line.split()[0]: " ".join(line.split()[1:4])
            for line in stack.ctl("status").splitlines() if line.strip()}


@pytest.fixture(scope="module")
def pids_before(tiny_stack):
    before = pids(tiny_stack)
    assert before and all(v.startswith("RUNNING") for v in before.values()), before
    yield before
    assert pids(tiny_stack) == before  # no input in this module restarted a process


CASES = {
    "deep_json": (b'{"texts": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", JSON),
    "deep_msgpack": (b"\x91" * 100_000 + b"\xc0", {"Content-Type": "application/msgpack"}),
    "huge_number": (b'{"texts": [1e99999999], "model": 123456789012345678901234567890}', JSON),
    "nan": (b'{"texts": [NaN, Infinity]}', JSON),
    "raw_nul": (b'{"texts": ["a\x00b"]}', JSON),
    "invalid_utf8_in_string": (b'{"texts": ["\xc3\x28"]}', JSON),
    "truncated_msgpack": (msgpack.packb({"texts": ["abc"]})[:-2],
                          {"Content-Type": "application/msgpack"}),
    "msgpack_bytes_not_str": (msgpack.packb({"texts": [b"\xff\xfe"]}),
                              {"Content-Type": "application/msgpack"}),
    "msgpack_int_keys": (msgpack.packb({1: ["x"]}), {"Content-Type": "application/msgpack"}),
    "text_plain": (b"hello", {"Content-Type": "text/plain"}),
    "empty_body": (b"", JSON),
    "json_scalar": (b"42", JSON),
    "texts_null": (b'{"texts": null}', JSON),
    "texts_dict": (b'{"texts": {"a": 1}}', JSON),
    "empty_string": (b'{"texts": [""]}', JSON),
    "model_list": (b'{"texts": ["a"], "model": ["m"]}', JSON),
    "hundred_thousand_texts": (json.dumps({"texts": ["a"] * 100_000}).encode(), JSON),
    "million_char_text": (json.dumps({"texts": ["a" * 1_000_000]}).encode(), JSON),
    "ten_mb_body": (b'{"texts": ["' + b"b" * (10 << 20) + b'"]}', JSON),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("path", ["/predict", "/v1/embeddings"])
def test_broken_input_is_a_4xx_with_an_error_body(tiny_stack, pids_before, name, path):
    body, headers = CASES[name]
    if path == "/v1/embeddings":
        body = body.replace(b'"texts"', b'"input"')
    status, resp_headers, raw = tiny_stack.request("POST", path, body, headers)
    assert 400 <= status < 500, (status, raw[:300])
    error = json.loads(raw)["error"]
    assert error["type"] and error["message"]


@pytest.mark.parametrize("encoding,status,kind", [
    ("gzip", 400, "bad_request"), ("deflate", 400, "bad_request"), ("br", 400, "bad_request"),
    ("zstd", 415, "unsupported_media_type"), ("compress", 415, "unsupported_media_type"),
])
def test_a_body_that_does_not_decode_as_its_content_encoding(tiny_stack, pids_before, encoding,
                                                            status, kind):
    # Not inflatable: the frontend's 400 in JSON (it was a 500 and a traceback, or aiohttp's
    # plain-text 400). A coding it cannot inflate: nginx's 415 (it was aiohttp's plain-text
    # 400, or the body read as identity). A bomb: 413.
    for path in ("/predict", "/v1/embeddings"):
        got, _, raw = tiny_stack.request("POST", path, b'{"texts": ["x"], "input": "x"}',
                                         {**JSON, "Content-Encoding": encoding})
        assert got == status and json.loads(raw)["error"]["type"] == kind, raw
    got, _, raw = tiny_stack.request("POST", "/v2/models/tiny/infer", b"{}",
                                     {**JSON, "Content-Encoding": encoding})
    assert got == status and json.loads(raw)["error"], raw  # KServe's {"error": "..."}
    for coding, packed in (("gzip", gzip.compress), ("deflate", zlib.compress),
                           ("br", brotli.compress)):  # what inflates is served
        got, _, raw = tiny_stack.request("POST", "/predict", packed(b'{"texts": ["x"]}'),
                                         {**JSON, "Content-Encoding": coding})
        assert got == 200, (coding, raw)
    if encoding == "gzip":
        bomb = gzip.compress(b" " * (64 << 20))  # 64 KiB that inflate to 64 MiB
        got, _, raw = tiny_stack.request("POST", "/predict", bomb,
                                         {**JSON, "Content-Encoding": "gzip"})
        assert got == 413 and "inflates to more than" in json.loads(raw)["error"]["message"]


@pytest.mark.parametrize("body", [
    {"texts": ["a\u0000b"]},  # an escaped NUL is an ordinary character in a text
    {"texts": ["ok"], "unknown_field": {"nested": [1, 2]}},  # extra fields are ignored
    {"texts": ["\U0001F600 emoji and \u202e bidi"]},
])
def test_odd_but_valid_input_is_served(tiny_stack, pids_before, body):
    status, _, resp = tiny_stack.post_json("/predict", body)
    assert status == 200 and len(resp["results"]) == 1


def test_header_abuse_is_refused_by_nginx(tiny_stack, pids_before):
    status, _, raw = tiny_stack.request("POST", "/predict", b'{"texts": ["x"]}',
                                        {**JSON, "X-Junk": "j" * 40_000})
    assert status in (400, 431) and json.loads(raw)["error"]["type"]
    status, _, _ = tiny_stack.request("POST", "/predict", b'{"texts": ["x"]}',
                                      {**JSON, "X-Priority": "urgent!!"})
    assert status == 422


def test_bounded_fuzz_of_the_live_server(tiny_stack, pids_before):
    """Random bodies, content types and headers through nginx: never a 5xx."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    values = st.recursive(
        st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.text(max_size=40)
        | st.floats(allow_nan=False, allow_infinity=False),
        lambda inner: st.lists(inner, max_size=6) | st.dictionaries(
            st.sampled_from(["texts", "input", "model", "priority", "encoding_format", "x"]),
            inner, max_size=4),
        max_leaves=20)
    valid = st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=4).map(
        lambda t: json.dumps({"texts": t, "input": t}).encode())
    bodies = st.one_of(
        valid, valid,
        values.map(lambda v: json.dumps(v).encode()),
        values.map(lambda v: msgpack.packb(v)),
        st.binary(max_size=300))
    seen = []

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/predict", "/v1/embeddings", "/v1/models", "/nope"]),
           body=bodies,
           ctype=st.sampled_from(["application/json", "application/json", "application/msgpack",
                                  "text/plain", ""]),
           accept=st.sampled_from(["", "application/msgpack", "*/*"]),
           priority=st.sampled_from([None, "high", "11", "-3", "x"]))
    def probe(path, body, ctype, accept, priority):
        headers = {k: v for k, v in {"Content-Type": ctype, "Accept": accept,
                                     "X-Priority": priority}.items() if v}
        status, _, _ = tiny_stack.request("POST", path, body, headers)
        seen.append(status)
        assert status < 500, (path, body[:200], headers, status)

    probe()
    assert len(seen) == 150 and 200 in seen  # some valid requests got through, too
