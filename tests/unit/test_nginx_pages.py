"""nginx itself, as `shmserve up` renders it, with nothing behind it: the error pages it serves
(both formats, KServe's shape under /v2, the request id) and CORS, which it answers alone."""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import subprocess
import sys
from typing import Callable

import msgpack
import pytest

from shmserve import config, nginxrun, render, topology
from shmserve.config import Config
from tests.unit.test_render import make_config, port_answers, wait_until

APP = "https://app.example:8443"  # the origin bare_nginx allows (CORS)


@contextlib.contextmanager
def nginx_of(cfg: Config, before: Callable[[], None] = lambda: None):
    """nginx rendered from `cfg` and started as `shmserve up` starts it (nginxrun), until the
    block ends; `before` runs between rendering and the start (frontends' sockets, say)."""
    render.render(cfg)
    before()
    conf = render.nginx_conf(cfg)
    log = (topology.log_dir(cfg) / "nginx.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "shmserve.nginxrun", "--binary",
                             render.nginx_binary(cfg), str(conf)], stdout=log, stderr=log)
    try:
        wait_until(lambda: port_answers(cfg.server.port) or proc.poll() is not None, 30)
        assert proc.poll() is None, (topology.log_dir(cfg) / "nginx.log").read_text()
        yield cfg
    finally:
        proc.send_signal(signal.SIGQUIT)
        proc.wait(timeout=30)
        nginxrun.kill_all(conf)
        log.close()


@pytest.fixture(scope="module")
def bare_nginx(tmp_path_factory):
    cfg = make_config(tmp_path_factory.mktemp("nginx") / "run", frontends={"count": 1},
                      nginx={"client_max_body_size": "1k", "large_client_header_buffers": "2 1k",
                             "cors_allow_origins": [APP, "http://[::1]:3000"]})
    with nginx_of(cfg):
        yield cfg


def request(cfg: Config, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", cfg.server.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


@pytest.mark.parametrize("accept", [
    "application/json", "application/msgpack", "application/x-msgpack, */*;q=0.1", "",
    "Application/MsgPack", "application/vnd.msgpack", "application/json, application/msgpack",
    "application/json, application/msgpack;q=0.1", "application/msgpack;q=0",
    "application/msgpack; q=0.0, */*", "application/msgpack, application/json;q=0.9",
    "*/*", "application/msgpack, */*", "application/msgpack;q=nan", "application/msgpack;q=high",
    "application/msgpack;q=2", "application/msgpack;q=0.1234", "application/msgpack;q=0.5;ext=1",
    # spaces around '=' and parameters before q, as the frontends read them (an outside check)
    "application/msgpack;q= 0.5", "application/msgpack ; q = 0.5", "application/msgpack;a=b;q=0",
    "application/msgpack;a=b;q=nan", "application/msgpack;a=b;q=0.5"])
def test_no_frontend_is_a_502_in_the_accepted_format(bare_nginx, accept):
    """nginx's own pages pick the format the frontends' negotiation would."""
    from frontend.codec import prefers_msgpack

    status, headers, body = request(bare_nginx, "POST", "/v1/embeddings", b"{}",
                                    {"Accept": accept} if accept else {})
    assert status == 502
    if prefers_msgpack(accept):
        assert headers["Content-Type"] == "application/msgpack"
        error = msgpack.unpackb(body)["error"]
    else:
        assert headers["Content-Type"] == "application/json"
        error = json.loads(body)["error"]
    assert error["type"] == "unavailable"


@pytest.mark.parametrize("path", ["/v2", "/v2/models/m/infer", "/v2/health/ready"])
def test_v2_routes_get_kserves_error_shape_from_nginx_too(bare_nginx, path):
    # Triton's client builds its exception's text from body["error"], which must be a string.
    status, headers, body = request(bare_nginx, "POST", path, b"{}",
                                    {"X-Request-ID": "kserve-7"})
    assert status == 502 and headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"error": "no frontend answered; see `shmserve status`"}
    assert headers.get_all("X-Request-ID") == ["kserve-7"]
    status, _, body = request(bare_nginx, "POST", path, b"x" * 4096,
                              {"Accept": "application/msgpack"})
    assert status == 413 and isinstance(msgpack.unpackb(body)["error"], str)
    # Only /v2 and below: a path that merely starts with the letters keeps the other shape, and
    # so do Cohere's /v2/rerank and /v2/embed.
    for other in ("/v2x", "/v2/rerank", "/v2/embed"):
        status, _, body = request(bare_nginx, "POST", other, b"{}")
        assert status == 502 and json.loads(body)["error"]["type"] == "unavailable"


def test_body_over_the_limit_is_a_413_with_the_config_key(bare_nginx):
    status, headers, body = request(bare_nginx, "POST", "/v1/embeddings", b"x" * 4096,
                                    {"Accept": "application/msgpack"})
    assert status == 413 and headers["Content-Type"] == "application/msgpack"
    error = msgpack.unpackb(body)["error"]
    assert error["type"] == "too_large"
    assert "nginx.client_max_body_size" in error["message"]


def test_headers_over_the_limit_are_a_431(bare_nginx):
    status, _, body = request(bare_nginx, "GET", "/ready", headers={"X-Big": "b" * 8000})
    assert status == 431
    assert json.loads(body)["error"]["type"] == "headers_too_large"


def test_request_id_is_the_clients_or_nginxs_own(bare_nginx):
    _, headers, _ = request(bare_nginx, "GET", "/ready", headers={"X-Request-ID": "client-7"})
    assert headers.get_all("X-Request-ID") == ["client-7"]
    _, headers, _ = request(bare_nginx, "GET", "/ready", headers={"X-Request-ID": "bad id!"})
    assert len(headers["X-Request-ID"]) == 32 and headers["X-Request-ID"] != "bad id!"


def test_error_pages_are_not_reachable_from_outside(bare_nginx):
    status, _, body = request(bare_nginx, "GET", "/_shmserve_errors/502.json")
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found"


def test_a_cors_preflight_from_an_allowed_origin_is_answered_by_nginx(bare_nginx):
    # No frontend is behind this nginx: the 204 is nginx's own, so no API key is ever asked for.
    status, headers, body = request(bare_nginx, "OPTIONS", "/v1/embeddings", headers={
        "Origin": APP, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 204 and body == b""
    assert headers["Access-Control-Allow-Origin"] == APP
    assert headers["Access-Control-Allow-Methods"] == "GET, POST, OPTIONS"
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert headers["Access-Control-Max-Age"] == "600" and headers["Vary"] == "Origin"


@pytest.mark.parametrize("origin", ["https://evil.example", "https://app.example", ""])
def test_other_origins_get_no_cors_headers_and_no_preflight(bare_nginx, origin):
    status, headers, _ = request(bare_nginx, "OPTIONS", "/v1/embeddings", headers={
        **({"Origin": origin} if origin else {}), "Access-Control-Request-Method": "POST"})
    assert status == 502  # passed on to the (absent) frontends, which would answer 405
    assert not [k for k in headers if k.lower().startswith("access-control-")]
    assert headers["Vary"] == "Origin"  # a cache must not reuse this for an allowed origin


def test_nginxs_own_error_pages_are_readable_by_an_allowed_origin(bare_nginx):
    status, headers, body = request(bare_nginx, "POST", "/v1/embeddings", b"x" * 4096,
                                    {"Origin": "http://[::1]:3000"})
    assert status == 413 and json.loads(body)["error"]["type"] == "too_large"
    assert headers["Access-Control-Allow-Origin"] == "http://[::1]:3000"
    assert "X-Request-ID" in headers["Access-Control-Expose-Headers"]
    assert "Access-Control-Allow-Methods" not in headers  # preflight-only headers


def test_cors_off_by_default_and_any_origin_with_a_star(tmp_path):
    off = make_config(tmp_path / "a")
    render.render(off)
    text = render.nginx_conf(off).read_text()
    assert "add_header Vary" not in text and "$http_origin;" not in text
    star = make_config(tmp_path / "b", nginx={"cors_allow_origins": ["*"]})
    render.render(star)
    text = render.nginx_conf(star).read_text()
    assert 'default "*";' in text and "add_header Vary" not in text
    render.check_nginx(star, render.nginx_binary(star))


@pytest.mark.parametrize("origins", [["*", APP], ["https://app.example/path"], ["app.example"],
                                     ['https://a.example"; evil']])
def test_a_bad_cors_origin_is_refused_naming_the_key(tmp_path, origins):
    with pytest.raises(config.ConfigError, match="nginx.cors_allow_origins"):
        make_config(tmp_path, nginx={"cors_allow_origins": origins})


def fake_frontend(cfg: Config, index: int, respond: Callable[[str], tuple[str, bytes]]):
    """A listening socket for frontend `index` answering each request's path with
    `respond(path)` (Content-Type, body), the function that binds it (nginx_of's `before`),
    and the thread serving it, to start once nginx runs."""
    import socket
    import threading

    sock = socket.socket(socket.AF_UNIX)

    def answer(conn):
        with conn:
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
                while b"\r\n\r\n" in data:
                    head, data = data.split(b"\r\n\r\n", 1)
                    kind, body = respond(head.split(b" ")[1].decode())
                    conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\n"
                                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)

    def serve():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    def listen():
        sock.bind(str(topology.frontend_socket(cfg, index)))
        sock.listen(64)

    return sock, listen, threading.Thread(target=serve, daemon=True)


def test_a_probe_skips_a_frozen_frontend_for_the_next_one(tmp_path):
    """GET /ready, /health and /metrics through nginx when one frontend accepts connections and
    never answers (stopped, its event loop stuck): each is answered, by the live frontend, at
    most nginx.probe_timeout_s late (a scrape twice that), not left hanging for
    proxy_read_timeout."""
    import socket
    import time

    cfg = make_config(tmp_path / "run", frontends={"count": 2},
                      nginx={"probe_timeout_s": 1})
    frozen = socket.socket(socket.AF_UNIX)
    live, listen_live, serving = fake_frontend(cfg, 1, lambda path: ("text/plain", b"live"))

    def listen():  # once the run directory is rendered
        frozen.bind(str(topology.frontend_socket(cfg, 0)))
        frozen.listen(64)  # the kernel accepts for it; nobody reads
        listen_live()

    try:
        with nginx_of(cfg, listen):
            serving.start()
            times = []
            for path in ("/ready", "/health", "/v2/health/ready", "/metrics",
                         "/v2/models/m/ready") * 2:
                began = time.monotonic()
                status, _, body = request(cfg, "GET", path)
                times.append(time.monotonic() - began)
                assert (status, body) == (200, b"live"), (path, status, body)
        # the probe timeout (1 s; /metrics twice that) and the answer, not 120 s
        assert max(times) < 3.5, times
        assert max(times) >= 0.9, times  # some went to the frozen frontend first
    finally:
        frozen.close()
        live.close()


def raw(cfg: Config, data: bytes) -> bytes:
    """Bytes as sent (what http.client would not send), and the whole answer."""
    import socket

    with socket.create_connection(("127.0.0.1", cfg.server.port), timeout=10) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("method", ["TRACE", "CONNECT", "FOO", "PROPFIND"])
def test_a_method_no_route_takes_is_nginxs_405_in_the_error_shape(bare_nginx, method):
    """Unknown methods reached aiohttp, whose 400 is text/plain; TRACE and CONNECT got nginx's
    HTML page (an outside check)."""
    answer = raw(bare_nginx, f"{method} /v1/embeddings HTTP/1.1\r\nHost: x\r\n"
                             "Connection: close\r\n\r\n".encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 405"), answer[:200]
    assert b"Content-Type: application/json" in head
    assert b"Allow: GET, HEAD, POST, PUT, OPTIONS" in head
    assert json.loads(body)["error"]["type"] == "method_not_allowed"
    # PATCH and DELETE go on to the frontends (here absent), which name each route's methods.
    assert request(bare_nginx, "DELETE", "/v1/embeddings")[0] == 502


@pytest.mark.parametrize("data,status,kind", [
    (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n"
     b"Connection: close\r\n\r\n0\r\n\r\n", 501, "not_implemented"),
    (b"GET /ready HTTP/2.0\r\nHost: x\r\nConnection: close\r\n\r\n", 505,
     "http_version_not_supported"),
])
def test_nginxs_501_and_505_are_in_the_error_shape(bare_nginx, data, status, kind):
    head, _, body = raw(bare_nginx, data).partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == str(status).encode(), head
    assert json.loads(body)["error"]["type"] == kind


@pytest.mark.parametrize("on", [True, False])
def test_gzip_compresses_json_and_text_for_clients_that_ask_when_on(tmp_path, on):
    """nginx.gzip: JSON answers of at least gzip_min_bytes go gzipped to a client that sends
    Accept-Encoding: gzip (with Vary), others as they are; msgpack never; off by default."""
    import gzip

    vectors = json.dumps({"data": [[0.0123456789] * 384] * 4}).encode()
    answers = {"/v1/embeddings": ("application/json; charset=utf-8", vectors),
               "/v2/models/m/infer": ("application/json", vectors),
               "/small": ("application/json", b'{"status": "ok"}'),
               "/predict": ("application/msgpack", msgpack.packb([[0.0123] * 384] * 4))}
    cfg = make_config(tmp_path / "run", frontends={"count": 1},
                      nginx={"gzip": True, "gzip_level": 6} if on else {})
    sock, listen, thread = fake_frontend(cfg, 0, lambda path: answers[path])
    try:
        with nginx_of(cfg, listen):
            thread.start()
            asking = {"Accept-Encoding": "gzip, deflate"}
            for path in ("/v1/embeddings", "/v2/models/m/infer"):
                status, headers, body = request(cfg, "GET", path, None, asking)
                assert status == 200
                if on:
                    assert headers["Content-Encoding"] == "gzip", path
                    assert "Accept-Encoding" in headers["Vary"]
                    assert gzip.decompress(body) == answers[path][1]
                    assert len(body) < len(answers[path][1]) / 2
                else:
                    assert "Content-Encoding" not in headers and body == answers[path][1]
                status, headers, body = request(cfg, "GET", path)  # not asked for
                assert "Content-Encoding" not in headers and body == answers[path][1]
            for path in ("/small", "/predict"):  # under gzip_min_bytes; msgpack
                status, headers, body = request(cfg, "GET", path, None, asking)
                assert "Content-Encoding" not in headers and body == answers[path][1], path
    finally:
        sock.close()
    assert ("gzip on;" in render.nginx_conf(cfg).read_text()) == on


@pytest.mark.parametrize("key,value", [("gzip_level", 0), ("gzip_level", 10),
                                       ("gzip_min_bytes", -1)])
def test_gzip_settings_out_of_range_are_refused_naming_the_key(tmp_path, key, value):
    with pytest.raises(config.ConfigError, match=f"nginx.{key}"):
        make_config(tmp_path, nginx={key: value})


@pytest.mark.parametrize("target", [b"/v1/models/caf\xc3\xa9", b"/health\xe9",
                                    b"/v1/models/\xe4\xb8\xad?q=1"])
def test_a_request_target_with_raw_non_ascii_bytes_is_nginxs_400(bare_nginx, target):
    """aiohttp's parser answered these itself: a plain 400 in JSON whatever the Accept, with
    no request id (an outside check)."""
    answer = raw(bare_nginx, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n"
                 b"Accept: application/msgpack\r\nX-Request-ID: raw-1\r\nConnection: close\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b"Content-Type: application/msgpack" in head and b"X-Request-ID: raw-1" in head
    assert msgpack.unpackb(body)["error"]["type"] == "bad_request"
    # Percent-encoded, the same path goes on (here to no frontend: 502).
    assert request(bare_nginx, "GET", "/v1/models/caf%C3%A9")[0] == 502
