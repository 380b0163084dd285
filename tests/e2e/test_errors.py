"""Every error status, provoked through nginx, with the error body in the negotiated format."""

import concurrent.futures
import json
import os
import re
import signal
import socket
import time

import msgpack
import pytest

from tests.conftest import tiny_overrides
from tests.e2e.test_reliability import inflight
from tests.stack import Stack
from tests.tinymodel import build_tiny_bert


def error_of(raw: bytes, as_msgpack: bool = False) -> dict:
    body = msgpack.unpackb(raw) if as_msgpack else json.loads(raw)
    assert set(body) == {"error", "message"}, body
    assert isinstance(body["error"]["type"], str) and body["error"]["message"]
    assert body["message"] == body["error"]["message"]  # where TEI's and Cohere's clients read
    assert set(body["error"]) == {"message", "type", "param", "code"}  # OpenAI's shape
    return body["error"]


ADMIN_TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def strict_stack(tmp_path_factory, tiny_model):
    """One frontend, a tiny worker queue, a short wait for workers, and a second model whose
    embedding table is smaller than its tokenizer's vocabulary: its forward fails; and an admin
    token."""
    broken = build_tiny_bert(tmp_path_factory.mktemp("models") / "broken", seed=1)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["vocab_size"] = 1000
    (broken / "config.json").write_text(json.dumps(cfg))
    import torch
    from safetensors.torch import load_file, save_file
    weights = load_file(broken / "model.safetensors")
    key = next(k for k in weights if k.endswith("word_embeddings.weight"))
    weights[key] = weights[key][:1000].clone()
    save_file({k: v.contiguous() for k, v in weights.items()}, broken / "model.safetensors",
              metadata={"format": "pt"})
    del torch
    overrides = tiny_overrides(tiny_model, frontends={"count": 1, "no_worker_wait_s": 0.5},
                               workers={"queue_texts": 24},
                               limits={"max_texts_per_request": 16})
    overrides["models"].append({"name": "broken", "source": str(broken), "revision": "b1"})
    overrides["model_roots"].append(str(broken.parent))
    stack = Stack(tmp_path_factory.mktemp("strict-stack"), overrides)
    stack.env["SHMSERVE__ADMIN__TOKEN"] = ADMIN_TOKEN  # as an operator's secret would set it
    stack.up()
    yield stack
    stack.down()


@pytest.mark.parametrize("body,ctype,kind,says", [
    (b'{"texts": [', "application/json", "bad_request", "unexpected end of data"),
    (b'{"texts": ["a"]} trailing', "application/json", "bad_request", "after document"),
    (b'{"texts": [NaN]}', "application/json", "bad_request",
     "malformed JSON body: unexpected character, expected a JSON value: line 1 column 12 "
     "(char 11) (NaN and Infinity are not JSON: send finite numbers)"),
    (b"\xff\xfe{}", "application/json", "bad_request", "the body is not valid UTF-8"),
    (b'{"texts": ["\xc3("]}', "application/json", "bad_request", "the body is not valid UTF-8"),
    (b"\xc1\xc1", "application/msgpack", "bad_request", "(FormatError)"),
    (b"texts=a", "application/x-www-form-urlencoded", "unsupported_media_type", "send"),
])
def test_malformed_bodies(tiny_stack, body, ctype, kind, says):
    status, headers, raw = tiny_stack.request("POST", "/predict", body, {"Content-Type": ctype})
    assert status == (415 if kind == "unsupported_media_type" else 400)
    error = error_of(raw)
    assert error["type"] == kind
    # Something after the colon, and words a user can act on (not orjson's "surrogates").
    assert says in error["message"] and not error["message"].endswith(": ")
    assert "surrogates" not in error["message"]
    assert headers["Content-Type"].startswith("application/json")
    assert headers["X-Request-ID"]


def test_a_json_body_in_the_charset_its_content_type_names_embeds_as_in_utf_8(tiny_stack):
    """`application/json; charset=latin-1` (some clients still send it): read as UTF-8, its
    accented letters were refused as invalid UTF-8. Now the same vector as the UTF-8 body; a
    charset the server does not read is a 415 through nginx."""
    text = "crème brûlée à la française"

    def embed(raw: bytes, ctype: str):
        status, _, body = tiny_stack.request("POST", "/v1/embeddings", raw,
                                             {"Content-Type": ctype})
        return status, json.loads(body)

    doc = {"model": "tiny", "input": [text]}
    status, utf8 = embed(json.dumps(doc, ensure_ascii=False).encode(), "application/json")
    assert status == 200, utf8
    for charset in ("latin-1", "utf-16"):
        status, other = embed(json.dumps(doc, ensure_ascii=False).encode(charset),
                              f"application/json; charset={charset}")
        assert status == 200, other
        assert other["data"][0]["embedding"] == utf8["data"][0]["embedding"]
    status, refused = embed(json.dumps(doc).encode(), "application/json; charset=klingon")
    assert status == 415 and "charset 'klingon'" in refused["error"]["message"], refused


def test_malformed_msgpack_answers_in_msgpack(tiny_stack):
    status, headers, raw = tiny_stack.request(
        "POST", "/predict", b"\xc1", {"Content-Type": "application/msgpack",
                                      "Accept": "application/msgpack"})
    assert status == 400 and headers["Content-Type"].startswith("application/msgpack")
    assert error_of(raw, as_msgpack=True)["type"] == "bad_request"


@pytest.mark.parametrize("path,body,param", [
    ("/predict", {}, "texts"),
    ("/predict", {"texts": []}, "texts"),
    ("/predict", {"texts": 5}, "texts"),
    ("/predict", {"texts": ["ok", 3]}, "texts"),
    ("/predict", {"texts": ["ok", ""]}, "texts"),
    ("/predict", {"texts": ["ok"], "model": 5}, "model"),
    ("/v1/embeddings", {"model": "tiny"}, "input"),
    ("/v1/embeddings", {"input": [None]}, "input"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/predict", [1, 2], None),
])
def test_missing_empty_or_wrongly_typed_fields_are_422(tiny_stack, path, body, param):
    """422, as TEI answers; OpenAI's route answers 400, as OpenAI does (its clients raise
    BadRequestError for 400 and UnprocessableEntityError for 422)."""
    status, _, err = tiny_stack.post_json(path, body)
    assert status == (400 if path == "/v1/embeddings" else 422), err
    assert err["error"]["type"] == "invalid_request"
    assert err["error"].get("param") == param


def test_too_many_texts_is_413_and_400_on_openais_route(tiny_stack):
    status, _, err = tiny_stack.post_json("/predict", {"texts": ["a"] * 65})
    assert status == 413 and "limits.max_texts_per_request" in err["error"]["message"]
    status, _, err = tiny_stack.post_json("/v1/embeddings", {"input": ["a"] * 65})
    assert status == 400 and err["error"]["type"] == "too_large", err


def test_over_long_text_without_truncation_is_413_and_400_on_openais_route(tiny_stack):
    status, _, err = tiny_stack.post_json("/embed", {"inputs": ["fine", "word " * 200]})
    assert status == 413, err
    status, _, err = tiny_stack.post_json("/v1/embeddings", {"input": ["fine", "word " * 200]})
    assert status == 400 and err["error"]["param"] == "input"
    assert "input[1]" in err["error"]["message"]


def test_unknown_model_is_404(tiny_stack):
    status, _, err = tiny_stack.post_json("/v1/embeddings", {"input": "x", "model": "gpt-9"})
    assert status == 404 and err["error"]["param"] == "model"


def test_unknown_route_and_method(tiny_stack):
    status, _, raw = tiny_stack.get("/nope")
    assert status == 404 and error_of(raw)["type"] == "not_found"
    assert error_of(raw)["message"] == "no route /nope (GET /openapi.json lists the routes)"
    # A base URL with /v1 too many (or without it: but /embeddings serves, as infinity's
    # route, frontend.infinity): the route it likely meant.
    assert tiny_stack.post_json("/embeddings", {"input": "x"})[0] == 200
    for path, meant in (("/v1/v1/embeddings", "/v1/embeddings"), ("/v1/predict", "/predict"),
                        ("/v1/tokenize", "/tokenize"),
                        # a base URL ending in "/": nginx routes it, the frontend does not
                        ("//v1/embeddings", "/v1/embeddings"), ("/v1//embeddings",
                                                                "/v1/embeddings")):
        status, _, err = tiny_stack.post_json(path, {"input": "x"})
        assert status == 404 and f"did you mean {meant}?" in err["error"]["message"], err
    # An encoded slash is not a slash (no route matched): the message says the path as sent,
    # not "no route /v1/embeddings", a route that exists (an outside check).
    status, _, err = tiny_stack.post_json("/v1%2Fembeddings", {"input": "x"})
    assert status == 404 and err["error"]["message"].startswith("no route /v1%2Fembeddings ")
    status, headers, raw = tiny_stack.get("/predict")
    assert status == 405 and error_of(raw)["type"] == "method_not_allowed"
    assert headers["Allow"] == "POST"  # RFC 9110
    assert error_of(raw)["message"] == "GET is not allowed on /predict; it takes POST"


@pytest.mark.parametrize("accept,as_msgpack", [("application/json", False),
                                               ("application/msgpack", True)])
def test_body_over_the_nginx_limit_is_413_from_nginx(tiny_stack, accept, as_msgpack):
    body = b'{"texts": ["' + b"a" * (9 << 20) + b'"]}'
    status, headers, raw = tiny_stack.request("POST", "/predict", body,
                                              {"Content-Type": "application/json",
                                               "Accept": accept})
    assert status == 413
    assert error_of(raw, as_msgpack)["type"] == "too_large"


def test_deadline_passed_is_504(tiny_stack):
    status, headers, err = tiny_stack.post_json("/predict", {"texts": ["late"] * 8},
                                                {"X-Request-Timeout": "0.000001"})
    assert status == 504 and err["error"]["type"] == "timeout"
    assert err["error"]["message"].startswith("request deadline passed (X-Request-Timeout) (")
    # The client's own deadline: sent again, it passes again. openai's client re-sent every
    # 5xx twice (three attempts, three times the work: an outside check); it obeys
    # X-Should-Retry, which OpenAI's API sends.
    assert headers.get("X-Should-Retry") == "false" and "Retry-After" not in headers
    import openai

    client = openai.OpenAI(base_url=tiny_stack.url + "/v1", api_key="unused")  # 2 retries
    with pytest.raises(openai.APIStatusError) as info:
        client.embeddings.create(model="tiny", input=["late"] * 8, extra_headers={
            "X-Request-Timeout": "0.000001", "X-Request-ID": "late-once"})
    assert info.value.status_code == 504
    frontends = [f"frontend-{i}" for i in range(tiny_stack.deployed().frontends.count)]
    time.sleep(0.5)  # (a retry would come at once: openai waits ~0.5-1 s without Retry-After)
    attempts = tiny_stack.settled(
        lambda: [line for name in frontends for line in tiny_stack.log_lines(name, whole=True)
                 if line.get("request_id") == "late-once"], lambda found: len(found) >= 1)
    assert [line["status"] for line in attempts] == [504], attempts


@pytest.mark.parametrize("count,chars", [(8, 4), (60, 200)])  # tokenized inline; in a thread
def test_work_past_its_deadline_never_reaches_a_worker(tiny_stack, count, chars):
    """The deadline is checked once tokenizing is done, and holds during tokenizing in a thread:
    a request whose deadline passed there got its 504 after tokenizing, and its work went to a
    worker anyway (which dropped it: a `request.dropped` line)."""
    late = f"late-{count}"
    texts = [("word " * chars)[:chars] for _ in range(count)]
    status, _, err = tiny_stack.post_json("/predict", {"texts": texts},
                                          {"X-Request-Timeout": "0.000001", "X-Request-ID": late})
    assert status == 504 and err["error"]["type"] == "timeout"
    after = f"after-{count}"
    assert tiny_stack.post_json("/predict", {"texts": ["x"]}, {"X-Request-ID": after})[0] == 200

    def worker_lines():
        return [json.dumps(line) for name in ("worker-0",) for line in tiny_stack.log_lines(name)]
    tiny_stack.wait_until(lambda: any(after in line for line in worker_lines()), 10,
                          "the worker's line of the next request")
    assert not [line for line in worker_lines() if late in line]


def test_a_deadline_counts_from_when_the_frontend_began_the_request(tiny_stack):
    """Reading and parsing the body count against the deadline: it began after them, so a 0.05
    s deadline was answered 504 after ~105 ms under load (a noted gap). Here a body that
    takes 0.6 s to arrive, sent to a frontend's own socket (nginx would buffer it whole
    first), with a 0.3 s deadline: 504, where the tiny model answers in milliseconds."""
    from shmserve import topology

    path = str(topology.frontend_socket(tiny_stack.deployed(), 0))
    body = json.dumps({"texts": ["slow body"]}).encode()

    def post(timeout: str, pause: float) -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(10)
            conn.connect(path)
            conn.sendall(b"POST /predict HTTP/1.1\r\nHost: f\r\nConnection: close\r\n"
                         b"Content-Type: application/json\r\nX-Request-Timeout: "
                         + timeout.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
                         + body[:5])
            time.sleep(pause)
            conn.sendall(body[5:])
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
            return answer

    late = post("0.3", 0.6)
    assert late.startswith(b"HTTP/1.1 504 "), late[:200]
    assert b"request deadline passed (X-Request-Timeout)" in late
    assert post("30", 0.6).startswith(b"HTTP/1.1 200 ")  # the same, in time


def test_bad_timeout_header_is_422(tiny_stack):
    status, _, err = tiny_stack.post_json("/predict", {"texts": ["x"]},
                                          {"X-Request-Timeout": "soon"})
    assert status == 422 and err["error"]["param"] == "X-Request-Timeout"
    status, _, err = tiny_stack.post_json("/predict", {"texts": ["x"]},
                                          {"X-Request-Timeout": "3601"})
    assert status == 422 and "(0, 3600]" in err["error"]["message"]
    # Past nginx's proxy_read_timeout_s a deadline is cut under it (tests/unit/test_app.py):
    # served as any other.
    assert tiny_stack.post_json("/predict", {"texts": ["x"]},
                                {"X-Request-Timeout": "3600"})[0] == 200


def test_worker_queue_full_is_429_with_retry_after(strict_stack):
    # The worker's queue holds 24 texts: one request of 16 at a time. (A request larger than
    # the queue could never be queued: the config refuses that, tests/unit/test_config.py.)
    # At normal priority, named: one of 16 naming none would be a bulk one, a step below,
    # which may fill only workers.low_priority_queue_share of the queue.
    body = {"texts": [f"queue full {i} " * 8 for i in range(16)], "priority": "normal"}
    with concurrent.futures.ThreadPoolExecutor(30) as pool:
        answers = list(pool.map(lambda _: strict_stack.post_json("/predict", body), range(60)))
    statuses = [status for status, _, _ in answers]
    assert set(statuses) <= {200, 429} and 200 in statuses, statuses
    full = [(headers, err) for status, headers, err in answers if status == 429
            and "worker queue full" in err["error"]["message"]]
    assert full, statuses
    for headers, err in full:
        assert err["error"]["type"] == "overloaded" and int(headers["Retry-After"]) >= 1
        # what passes the bound: the queued texts and this request's together
        assert re.match(r"worker queue full: \d+ texts queued, and this request's 16 would "
                        r"pass the 24 of workers\.queue_texts", err["error"]["message"]), err
    assert strict_stack.post_json("/predict", body)[0] == 200
    # Naming none, a step below: its 429 says why it met below-normal priority's share
    bulk = {"texts": body["texts"]}
    with concurrent.futures.ThreadPoolExecutor(30) as pool:
        answers = list(pool.map(lambda _: strict_stack.post_json("/predict", bulk), range(60)))
    full = [err["error"]["message"] for status, _, err in answers if status == 429]
    assert full, [status for status, _, _ in answers]
    for message in full:
        assert message.endswith("(a request of 16 texts that names no priority runs a step "
                                "below the default, behind smaller ones: frontends.bulk_texts; "
                                "X-Priority, or the body's priority, sets its own)"), message


def test_unexpected_failure_is_500_with_request_id_and_worker_survives(strict_stack):
    status, headers, err = strict_stack.post_json(
        "/predict", {"texts": ["words beyond the first thousand ids"], "model": "broken"},
        {"X-Request-ID": "boom-1"})
    assert status == 500 and err["error"]["type"] == "internal_error"
    assert "boom-1" in err["error"]["message"]
    assert "Traceback" not in json.dumps(err)
    assert strict_stack.post_json("/predict", {"texts": ["still fine"]})[0] == 200


def test_no_live_worker_is_503_then_service_returns(strict_stack):
    strict_stack.ctl("stop", "workers:*")
    try:
        status, headers, err = strict_stack.post_json("/predict", {"texts": ["x"]})
        assert status == 503 and err["error"]["type"] == "unavailable"
        assert err["error"]["message"].startswith("no live worker for this model")  # not loading
        assert headers.get("Retry-After")
        status, headers, raw = strict_stack.get("/ready")
        assert status == 503 and json.loads(raw)["status"] == "unavailable"
        assert headers.get("Retry-After") == "1"  # as the inference routes' 503s
        assert strict_stack.get("/v2/health/ready")[0] == 400  # KServe's "false" is a 4xx
        assert json.loads(strict_stack.get("/v2/models/tiny/ready")[2])["ready"] is False
    finally:
        strict_stack.ctl("start", "workers:*")
    strict_stack.wait_until(lambda: strict_stack.get("/ready")[0] == 200, 120, "ready again")
    assert strict_stack.post_json("/predict", {"texts": ["back"]})[0] == 200


def test_admin_routes_are_off_without_a_token(tiny_stack):
    status, _, raw = tiny_stack.get("/admin/models", {"Authorization": "Bearer anything"})
    assert status == 404 and json.loads(raw)["error"]["type"] == "not_found"


def test_admin_routes_need_the_token(strict_stack):
    stack = strict_stack
    for headers, why in (({}, "no Authorization header"),
                         ({"Authorization": "Bearer wrong"}, "not this server's admin.token"),
                         ({"Authorization": ADMIN_TOKEN}, "not 'Bearer <token>'"),
                         ({"Authorization": f"Basic {ADMIN_TOKEN}"}, "not 'Bearer <token>'")):
        status, _, raw = stack.get("/admin/models", headers)
        error = json.loads(raw)["error"]
        assert status == 401 and error["type"] == "unauthorized"
        assert error["message"].endswith(why), (headers, error)
    status, _, raw = stack.get("/admin/models", {"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert status == 200
    models = {m["name"]: m for m in json.loads(raw)["models"]}
    assert set(models) == {"tiny", "broken"}
    assert [(w["state"], w["revision"]) for w in models["tiny"]["workers"]] == \
        [("ready", "tiny-r1")]
    # A token that is not UTF-8: no match (it was a 500 and a traceback, for anyone).
    assert raw_request(stack, b"GET /admin/models HTTP/1.1\r\nHost: x\r\n"
                       b"Authorization: Bearer \xe9t\xe9-token\r\n"
                       b"Connection: close\r\n\r\n").startswith(b"HTTP/1.1 401 ")
    # From another address (127.0.0.2 is loopback to the kernel, not to nginx's rule): 403
    # from nginx, and 403 from the frontend for an encoded path nginx does not file under
    # /admin/ (it reached the token check: 404 with the token, 401 without, from anywhere).
    token = ADMIN_TOKEN.encode()
    sneak = (b"POST /admin/models/..%2F..%2Fnosuch/reload HTTP/1.1\r\nHost: x\r\n"
             b"Authorization: Bearer " + token + b"\r\nContent-Length: 0\r\n"
             b"Connection: close\r\n\r\n")
    plain = (b"GET /admin/models HTTP/1.1\r\nHost: x\r\n"
             b"Authorization: Bearer " + token + b"\r\nConnection: close\r\n\r\n")
    for request in (plain, sneak):
        answer = raw_request(stack, request, source="127.0.0.2")
        assert answer.startswith(b"HTTP/1.1 403 "), answer
        assert b"loopback clients only" in answer
    assert raw_request(stack, sneak).startswith(b"HTTP/1.1 404 ")  # from loopback


def raw_request(stack: Stack, data: bytes, source: str = "127.0.0.1") -> bytes:
    with socket.create_connection(("127.0.0.1", stack.port), timeout=30,
                                  source_address=(source, 0)) as conn:
        conn.sendall(data)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


def test_a_lost_workers_requests_are_named_in_the_logs(tmp_path, tiny_model):
    """A worker killed with requests in it, and no other to take them: the frontend's
    frontend.worker_lost line names them, and each access line says worker_lost at level
    warning (an outside check could not tell them from a cold start's 503s by their lines, nor
    find them by request id: the lost line gave a count, the access lines no_worker_ready)."""
    stack = Stack(tmp_path / "s", tiny_overrides(
        tiny_model, frontends={"count": 1, "no_worker_wait_s": 0.2},
        workers={"heartbeat_timeout_s": 60, "hung_kill_s": 120}))
    stack.up()
    try:
        worker = stack.pid("workers:worker-0")
        os.kill(worker, signal.SIGSTOP)  # the requests wait in it
        ids = [f"lost-{i}" for i in range(3)]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            waiting = [pool.submit(stack.post_json, "/v1/embeddings", {"input": ["w"]},
                                   {"X-Request-ID": rid}) for rid in ids]
            stack.wait_until(lambda: inflight(stack) == 3, 30, "the requests to wait")
            os.kill(worker, signal.SIGKILL)
            answers = [future.result(timeout=30) for future in waiting]
        assert [status for status, _, _ in answers] == [503] * 3, answers
        assert all(body["error"]["message"].startswith("its worker was lost")
                   for _, _, body in answers), answers

        def lines(message):
            return [line for line in stack.log_lines("frontend-0")
                    if line.get("message") == message]
        stack.wait_until(lambda: len([x for x in lines("request")
                                      if x["request_id"] in ids]) == 3, 10, "the access lines")
        (lost,) = lines("frontend.worker_lost")
        assert sorted(lost["request_ids"]) == ids and lost["pending"] == 3, lost
        for line in (x for x in lines("request") if x["request_id"] in ids):
            assert (line["level"], line["status"], line["error_reason"], line["worker"]) == (
                "warning", 503, "worker_lost", 0), line  # the worker it was lost with
    finally:
        stack.down()
