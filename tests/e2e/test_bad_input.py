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
        for path in ("/predict", "/v1/embeddings"):  # 413 on OpenAI's route too, as nginx's
            got, _, raw = tiny_stack.request("POST", path, bomb,
                                             {**JSON, "Content-Encoding": "gzip"})
            assert got == 413 and "inflates to more than" in json.loads(raw)["error"]["message"]


def test_content_encoding_given_on_two_lines_is_one_list(tiny_stack):
    """Two Content-Encoding lines are the list of both (RFC 9110), refused as nginx refuses
    "gzip, gzip" on one line: the frontend read the first line alone, so a second coding
    went unapplied and a body served (an outside check)."""
    from tests.e2e.test_errors import raw_request

    body = gzip.compress(b'{"texts": ["x"]}')
    for second in ("zstd", "gzip"):
        answer = raw_request(tiny_stack, (
            f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Encoding: gzip\r\nContent-Encoding: {second}\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
        assert answer.startswith(b"HTTP/1.1 415 "), answer[:300]
        assert b"Content-Encoding must be gzip" in answer, answer[-300:]


@pytest.mark.parametrize("body", [
    {"texts": ["a\u0000b"]},  # an escaped NUL is an ordinary character in a text
    {"texts": ["ok"], "unknown_field": {"nested": [1, 2]}},  # extra fields are ignored
    {"texts": ["\U0001F600 emoji and \u202e bidi"]},
])
def test_odd_but_valid_input_is_served(tiny_stack, pids_before, body):
    status, _, resp = tiny_stack.post_json("/predict", body)
    assert status == 200 and len(resp["results"]) == 1


def test_a_json_body_after_a_utf8_byte_order_mark_is_served(tiny_stack):
    """RFC 8259 lets a parser ignore a BOM; a file a Windows editor saved, sent with curl
    --data-binary @file, begins with one and was refused 400 (an outside check)."""
    body = b'{"texts": ["x"], "input": "x"}'
    for path in ("/predict", "/v1/embeddings"):
        status, _, plain = tiny_stack.request("POST", path, body, JSON)
        assert status == 200, plain
        status, _, marked = tiny_stack.request("POST", path, b"\xef\xbb\xbf" + body, JSON)
        assert status == 200, marked
        assert json.loads(marked).keys() == json.loads(plain).keys()


def test_header_abuse_is_refused_by_nginx(tiny_stack, pids_before):
    status, _, raw = tiny_stack.request("POST", "/predict", b'{"texts": ["x"]}',
                                        {**JSON, "X-Junk": "j" * 40_000})
    assert status in (400, 431) and json.loads(raw)["error"]["type"]
    status, _, _ = tiny_stack.request("POST", "/predict", b'{"texts": ["x"]}',
                                      {**JSON, "X-Priority": "urgent!!"})
    assert status == 422


def test_many_headers_are_served_as_far_as_nginx_takes_them(tiny_stack, pids_before):
    """aiohttp's parser took 128 header lines: 122 short ones more than a request's own got
    its 400 "malformed HTTP request" (an outside check), which nginx had passed. Past nginx's
    buffers (4 x 16k), nginx's 431."""
    many = {f"X-H{i}": "v" for i in range(500)}
    status, _, raw = tiny_stack.request("POST", "/predict", b'{"texts": ["x"]}',
                                        {**JSON, **many})
    assert status == 200, raw[:300]
    past = {f"X-Header-{i}": "v" * 20 for i in range(3000)}  # ~100 KB of headers
    status, _, raw = tiny_stack.request("POST", "/predict", b'{"texts": ["x"]}',
                                        {**JSON, **past})
    assert status in (400, 431) and json.loads(raw)["error"]["type"] in (
        "headers_too_large", "bad_request"), raw[:300]


def exchange(stack, request: bytes) -> bytes:
    """Raw bytes to nginx (what no HTTP client library sends), and all of its answer."""
    import socket

    host, port = stack.url.removeprefix("http://").split(":")
    answer = b""
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_headers_nginx_passes_get_the_error_shape_and_are_never_quoted(tiny_stack, pids_before):
    """A header line nginx takes (up to one of its large header buffers, 16 KiB) was over
    aiohttp's own 8,190 bytes, and a control character in a header value reached aiohttp's
    parser: both got text/plain 400s quoting the header (a bearer token among them), in the
    answer and the frontend's log (an outside check)."""
    def frontend_logs() -> str:
        return "".join(p.read_text(errors="replace")
                       for p in (tiny_stack.run_dir / "logs").glob("frontend-*.log"))

    def malformed() -> int:
        return frontend_logs().count("http.malformed_request")

    before = malformed()
    token = "secret-" + "t" * 9000  # a long JWT, say
    status, headers, raw = tiny_stack.request("POST", "/predict", b'{"texts": ["x"]}',
                                              {**JSON, "X-Token": token})
    assert status == 200, raw[:300]  # within nginx's limit: served
    for value in (b"Bearer secret-\x01-key", b"a\x7fb"):
        answer = exchange(tiny_stack, b"POST /predict HTTP/1.1\r\nHost: x\r\nAuthorization: " +
                          value + b"\r\nContent-Type: application/json\r\nContent-Length: 15"
                          b"\r\nConnection: close\r\n\r\n{\"texts\": [\"x\"]}")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, answer[:300]
        assert json.loads(body)["error"]["type"] == "bad_request"
        assert b"secret" not in answer and b"a\x7fb" not in answer
    # log lines are written out every logging.flush_interval_ms (CI once read them too soon)
    tiny_stack.wait_until(lambda: malformed() >= before + 2, 10, "both malformed_request lines")
    # ... and the served one's access line (level info: in a frontend's buffer for up to the
    # interval, where the 400s' warnings, written at once, went to the other frontend)
    def served() -> bool:
        return any(line.get("request_id") == headers["X-Request-ID"]
                   for p in (tiny_stack.run_dir / "logs").glob("frontend-*.log")
                   for line in tiny_stack.log_lines(p.stem))
    tiny_stack.wait_until(served, 10, "the served request's access line")
    assert "secret-" not in frontend_logs()


def test_a_header_given_twice_is_named_in_the_400(tiny_stack, pids_before):
    """Two Content-Type headers: aiohttp refuses them, and the answer read "a control
    character in a header, or a line too long?" (an outside check)."""
    answer = exchange(tiny_stack, b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Type: application/json\r\nContent-Length: "
                      b"15\r\nConnection: close\r\n\r\n{\"texts\": [\"x\"]}")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:300]
    assert b"\r\nContent-Type: application/json\r\n" in head + b"\r\n", head  # as any error's
    assert body.startswith(b'{"error":{"message":'), body  # compact, as any error's
    error = json.loads(body)["error"]
    assert error["type"] == "bad_request"
    assert error["message"] == ("malformed HTTP request: the Content-Type header is given "
                                "twice; it may be given once"), error


@pytest.mark.parametrize("name", ["X-Request-Timeout", "X-Priority"])
def test_a_control_header_given_twice_is_refused_not_half_read(tiny_stack, pids_before, name):
    """The first was taken and the second never read: `5` then `abc` served, `abc` then `5`
    refused (an outside check)."""
    body = b'{"texts": ["x"]}'
    answer = exchange(tiny_stack, b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\n" + f"{name}: 5\r\n{name}: abc\r\n".encode()
                      + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                      + body)
    head, _, raw = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 422"), answer[:300]
    error = json.loads(raw)["error"]
    assert error["param"] == name and "given 2 times" in error["message"], error


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


def test_kserve_shapes_of_countless_huge_dimensions_are_refused_at_once(tiny_stack,
                                                                       pids_before):
    """140,000 dimensions of 2**63 - 1 (3 MB of JSON) held a frontend's loop in big-integer
    products past the workers' hung kill, and nginx sent the request on to the next frontend,
    which was killed too; 240 in the binary framing were a 500 (an outside check)."""
    import struct

    entry = {"name": "text", "datatype": "BYTES", "shape": [2**63 - 1] * 140_000,
             "data": ["a"]}
    status, _, raw = tiny_stack.request("POST", "/v2/models/tiny/infer",
                                        json.dumps({"inputs": [entry]}).encode(), JSON)
    assert status == 422 and len(raw) < 1000, (status, raw[:300])
    head = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES",
                                   "shape": [2**63 - 1] * 240,
                                   "parameters": {"binary_data_size": 9}}]}).encode()
    status, _, raw = tiny_stack.request(
        "POST", "/v2/models/tiny/infer", head + struct.pack("<I", 5) + b"hello",
        {"Content-Type": "application/octet-stream",
         "Inference-Header-Content-Length": str(len(head))})
    assert status == 422 and len(raw) < 1000, (status, raw[:300])


def test_a_gzipped_json_body_of_countless_objects_is_refused_before_it_is_parsed(tiny_stack,
                                                                                  pids_before):
    """8 MB of `{}`, 8 KB gzipped: ~200 MB of a frontend's memory a request (an outside check,
    1-2 GB a frontend under 24-64 such clients). Refused before orjson builds a dict."""
    import gzip

    bomb = b'{"texts": ["a"], "pad": [' + b"{}," * 2_700_000 + b"{}]}"
    status, _, raw = tiny_stack.request("POST", "/predict", gzip.compress(bomb), {
        "Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 400 and b"more than 131,072 arrays and objects" in raw, (status, raw[:300])


def test_a_msgpack_body_of_countless_empty_arrays_is_refused_as_it_is_read(tiny_stack,
                                                                           pids_before):
    """8 MB of empty arrays took a frontend 2 s and 600 MB to read (an outside check)."""
    n = (8 << 20) - 64
    status, _, raw = tiny_stack.request(
        "POST", "/v1/embeddings", b"\x81\xa5input\xdd" + n.to_bytes(4, "big") + b"\x90" * n,
        {"Content-Type": "application/msgpack"})
    assert status == 400 and b"more than 131,072 arrays and maps" in raw, (status, raw[:300])


def test_errors_quote_a_long_name_in_part(tiny_stack, pids_before):
    """An unknown model name of 100,000 characters came back whole in the 404."""
    for path, body in (("/v1/embeddings", {"input": "x", "model": "m" * 100_000}),
                       ("/embed", {"inputs": "x", "model": "m" * 100_000})):
        status, _, err = tiny_stack.post_json(path, body)
        assert status == 404 and "(100000 chars)" in err["error"]["message"]
        assert len(err["error"]["message"]) < 400
    status, _, raw = tiny_stack.request("POST", "/v2/models/" + "m" * 5000 + "/infer",
                                        b"{}", JSON)
    assert status == 404 and len(json.loads(raw)["error"]) < 400


def test_nginx_access_lines_stay_json_whatever_bytes_a_client_sends(tiny_stack, pids_before):
    """nginx's escape=json copies bytes over 0x7f as they are: a user agent or a request target
    that is not UTF-8 made its access line invalid JSON, which strict log shippers drop (an
    outside check). Such a field is logged as a marker; valid UTF-8 as sent."""
    cases = {
        "ua-bytes": b"POST /predict HTTP/1.1\r\nUser-Agent: ab\xff\xfecd\r\n",
        "ua-utf8": "POST /predict HTTP/1.1\r\nUser-Agent: naïve ü ✓\r\n".encode(),
        "uri-bytes": b"GET /health\xff\xfe HTTP/1.1\r\n",
        "ua-long": f"POST /predict HTTP/1.1\r\nUser-Agent: {'é' * 4000}\r\n".encode(),
        "ua-none": b"POST /predict HTTP/1.1\r\n",  # as Python's http.client sends
    }
    for rid, head in cases.items():
        answer = exchange(tiny_stack, head + b"Host: x\r\nX-Request-ID: " + rid.encode() +
                          b"\r\nContent-Type: application/json\r\nContent-Length: 16\r\n"
                          b"Connection: close\r\n\r\n{\"texts\": [\"x\"]}")
        assert answer.startswith(b"HTTP/1.1 200" if rid.startswith("ua") else
                                 b"HTTP/1.1 400"), answer[:300]
    log = tiny_stack.run_dir / "logs" / "nginx.log"

    def lines() -> dict[str, dict]:
        found = {}
        for raw in log.read_bytes().splitlines():
            if raw.startswith(b"{") and any(f'"{rid}"'.encode() in raw for rid in cases):
                line = json.loads(raw.decode("utf-8"))  # strict: raises on a byte not UTF-8
                found[line["request_id"]] = line
        return found
    tiny_stack.wait_until(lambda: len(lines()) == len(cases), 10, "nginx's access lines")
    found = lines()
    assert found["ua-bytes"]["user_agent"] == "(not UTF-8: left out)"
    assert found["ua-utf8"]["user_agent"] == "naïve ü ✓"
    assert found["ua-long"]["user_agent"] == "é" * 4000  # one pass over 8,000 bytes
    assert found["ua-utf8"]["uri"] == found["ua-bytes"]["uri"] == "/predict"
    assert found["uri-bytes"]["uri"] == "(not UTF-8: left out)"
    assert found["uri-bytes"]["status"] == 400
    # nothing sent is logged as nothing, not as the marker (an outside check: a map tries no
    # regex on an empty value)
    assert found["ua-none"]["user_agent"] == found["uri-bytes"]["user_agent"] == ""


# A body each POST route serves on the tiny stack (one embedding model), so that a field's
# odd value is read where the route reads it, not refused first for a missing field.
SERVED = {"/predict": {"texts": ["x"]}, "/v1/embeddings": {"input": ["x"]},
          "/v1/embed": {"texts": ["x"]}, "/v2/embed": {"texts": ["x"], "model": "tiny",
                                                       "embedding_types": ["float"]},
          "/embed": {"inputs": ["x"]}, "/embed_all": {"inputs": ["x"]},
          "/": {"inputs": "x"}, "/tokenize": {"inputs": ["x"]}, "/decode": {"ids": [[5]]},
          "/similarity": {"inputs": {"source_sentence": "x", "sentences": ["y"]}}}
ODD = [None, [], {}, [[]], [{}], {"a": [1]}, 1.5, -1, True, "", "x" * 300, [None]]


def _fields(schema: dict, components: dict, seen=()) -> set[str]:
    """Every property name a request schema (and the schemas it refers to) names."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return set() if name in seen else _fields(components[name], components, (*seen, name))
    names = set(schema.get("properties", {}))
    for key in ("oneOf", "anyOf", "allOf"):
        for part in schema.get(key, []):
            names |= _fields(part, components, seen)
    for part in schema.get("properties", {}).values():
        names |= _fields(part, components, seen)
    return names


def test_every_field_of_every_route_takes_odd_values_with_a_4xx(tiny_stack, pids_before):
    """Each field the OpenAPI document names for a route, set to a value of each odd type
    (null, lists, objects, a float, a negative, a bool, ...) in a body the route otherwise
    serves: answered 200 or 4xx, never 5xx. Cohere's `input_type` as a list was unhashable,
    a 500 (an outside check's fuzz)."""
    document = json.loads(tiny_stack.get("/openapi.json")[2])
    components = document["components"]["schemas"]
    tried = 0
    for path, base in SERVED.items():
        body_schema = document["paths"][path]["post"]["requestBody"]["content"]
        schema = next(iter(body_schema.values()))["schema"]
        for field in sorted(_fields(schema, components) | set(base)):
            for value in ODD:
                status, _, raw = tiny_stack.request(
                    "POST", path, json.dumps({**base, field: value}).encode(), JSON)
                tried += 1
                assert status < 500, (path, field, value, status, raw[:300])
                if status >= 400:
                    assert json.loads(raw)["error"]["message"], (path, field, value)
    assert tried > 500, tried


def test_values_a_route_cannot_use_are_refused_by_what_they_are(tiny_stack, pids_before):
    """An outside check's fuzz: top_k on an embedding model's /predict was taken and ignored
    (any value); 257 strings as /decode's ids were refused for their count, not for being
    strings; a KServe output without a name was "no output None"."""
    def post(path, body):
        status, _, raw = tiny_stack.request("POST", path, json.dumps(body).encode(), JSON)
        return status, json.loads(raw)["error"]

    status, error = post("/predict", {"texts": ["x"], "top_k": "x"})
    assert status == 422 and error["param"] == "top_k", error
    assert tiny_stack.post_json("/predict", {"texts": ["x"], "top_k": None})[0] == 200
    # a JSON integer past 2**53 reads as a float: the message says what is allowed
    status, error = post("/v1/embeddings", {"input": ["x"], "dimensions": 2 ** 64})
    assert status == 400 and "under 2**53" in error["message"], error
    status, error = post("/decode", {"ids": ["a"] * 257})
    assert status == 422 and "list of token ids" in error["message"], error
    status, error = post("/v2/models/tiny/infer", {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["x"]}],
        "outputs": [{"a": 1}]})
    assert 400 <= status < 500 and "needs a 'name'" in error, error
    # an output asked for twice was answered twice (Triton refuses it: an outside check)
    status, error = post("/v2/models/tiny/infer", {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["x"]}],
        "outputs": [{"name": "embedding"}, {"name": "embedding"}]})
    assert status == 422 and "asked for twice" in error, error
