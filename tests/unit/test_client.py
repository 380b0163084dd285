"""shmserve.client without a server: arguments, headers, error bodies, transport failures."""

import json
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

from shmserve.client import AsyncClient, Client, ShmserveError, _decode, _matrix
from tests.stack import free_port


def test_bad_arguments():
    for kwargs in ({"url": "localhost:8080"}, {"url": "http://x", "format": "xml"},
                   {"url": "http://x", "timeout": 0}):
        with pytest.raises(ValueError):
            Client(**kwargs)


def test_headers_carry_format_deadline_and_request_id():
    client = Client("http://127.0.0.1:1/prefix", timeout=2.5, format="json")
    body, headers = client._embed_request("one", "m", "rid-1")
    assert json.loads(body) == {"texts": ["one"], "model": "m"}
    assert headers == {"Accept": "application/json", "Content-Type": "application/json",
                       "X-Request-Timeout": "2.5", "X-Request-ID": "rid-1"}
    body, headers = Client("http://h", model="d")._embed_request(["a", "b"], None, None)
    assert msgpack.unpackb(body) == {"texts": ["a", "b"], "model": "d"}
    assert headers["Content-Type"] == "application/msgpack"


def test_an_api_key_is_sent_as_a_bearer_token(monkeypatch):
    monkeypatch.delenv("SHMSERVE_API_KEY", raising=False)
    assert "Authorization" not in Client("http://h")._headers(None)
    assert Client("http://h", api_key="k1")._headers(None)["Authorization"] == "Bearer k1"
    monkeypatch.setenv("SHMSERVE_API_KEY", "k2")
    assert Client("http://h")._headers(None)["Authorization"] == "Bearer k2"
    assert Client("http://h", api_key="k1")._headers(None)["Authorization"] == "Bearer k1"


def test_a_priority_is_sent_on_every_request_and_checked_first():
    # A batch job's client (priority="low") leaves the workers to interactive ones first.
    assert "X-Priority" not in Client("http://h")._headers(None)
    assert Client("http://h", priority="low")._embed_request("a", None, None)[1][
        "X-Priority"] == "low"
    assert Client("http://h", priority=-3)._headers(None)["X-Priority"] == "-3"
    for bad in ("urgent", 11, True, 1.5):
        with pytest.raises(ValueError, match="priority must be low, normal, high"):
            Client("http://h", priority=bad)


def test_error_bodies_become_typed_errors():
    body = {"error": {"message": "no", "type": "not_found", "param": "model",
                      "code": "model_not_found"}}
    for ctype, raw in (("application/json", json.dumps(body).encode()),
                       ("application/msgpack", msgpack.packb(body))):
        with pytest.raises(ShmserveError) as info:
            _decode(404, ctype, raw)
        err = info.value
        assert (err.status, err.type, err.param, err.code, err.message) == (
            404, "not_found", "model", "model_not_found", "no")
        assert err.body == body and str(err) == "404 no"
    with pytest.raises(ShmserveError) as info:  # a proxy's HTML page, say
        _decode(502, "text/html", b"<html>")
    assert info.value.status == 502 and info.value.body is None


def test_vectors_from_msgpack_bytes_or_json_lists():
    m = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(_matrix({"results": [r.tobytes() for r in m]}, False), m)
    np.testing.assert_array_equal(_matrix({"results": m.tolist()}, False), m)
    assert _matrix({"results": [m[0].tobytes()]}, True).shape == (3,)


def test_nothing_listening_is_a_typed_error_without_status():
    with Client(f"http://127.0.0.1:{free_port()}", timeout=5) as client:
        with pytest.raises(ShmserveError) as info:
            client.embed("x")
    assert info.value.status is None and info.value.body is None


async def test_async_nothing_listening():
    async with AsyncClient(f"http://127.0.0.1:{free_port()}", timeout=5) as client:
        assert await client.ready() is False  # a server still starting: wait and ask again
        with pytest.raises(ShmserveError) as info:
            await client.embed("x")
    assert info.value.status is None
    with Client(f"http://127.0.0.1:{free_port()}", timeout=5) as client:
        assert client.ready() is False


def test_what_the_answer_is_not_says_so():
    """/predict answers a classification model's labels: embed() says to use classify()."""
    labels = {"results": [[{"label": "a", "score": 0.9}]], "model": "clf"}
    with pytest.raises(ShmserveError, match="'clf' is a classification model.*classify") as info:
        _matrix(labels, False)
    assert (info.value.status, info.value.type, info.value.param, info.value.code) == (
        200, "invalid_request", "model", "unsupported_task")  # an answer came: not None
    with pytest.raises(TypeError, match="not one string"):
        Client("http://h")._rerank_request("q", "one document", None, None)


def test_importing_the_client_pulls_in_neither_aiohttp_nor_torch():
    code = ("import sys, shmserve.client; "
            "print(sorted(m for m in ('aiohttp', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == "[]"


def test_a_keepalive_connection_closed_while_idle_is_reopened_once():
    """A server that answers one request per connection without saying so, as a server does
    that times out an idle keep-alive connection between two requests."""
    import socket
    import threading

    body = msgpack.packb({"results": [np.ones(2, "<f4").tobytes()]})
    reply = (b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\n"
             b"Content-Length: %d\r\n\r\n" % len(body)) + body
    listener = socket.create_server(("127.0.0.1", 0))
    served = []

    def serve():
        for _ in range(2):
            conn, _ = listener.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, rest = data.split(b"\r\n\r\n", 1)
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                while len(rest) < length:
                    rest += conn.recv(65536)
                conn.sendall(reply)
                served.append(head.split(b"\r\n")[0])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with Client(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=10) as client:
            assert client.embed("a").tolist() == [1.0, 1.0]
            assert client.embed("b").tolist() == [1.0, 1.0]  # on a new connection
        thread.join(10)
        assert served == [b"POST /predict HTTP/1.1"] * 2
    finally:
        listener.close()


def test_a_request_sent_as_the_server_closes_an_idle_connection_is_sent_again():
    """The race a keep-alive connection has: the server closes it (idle timeout, a restarted
    nginx) just as the client sends the next request on it. Both clients send it once more on
    a new connection (inference is idempotent)."""
    import asyncio
    import socket
    import threading

    body = msgpack.packb({"results": [np.ones(2, "<f4").tobytes()]})
    reply = (b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\n"
             b"Content-Length: %d\r\n\r\n" % len(body)) + body
    listener = socket.create_server(("127.0.0.1", 0))
    answered = []

    def read_request(conn) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return b""
            data += chunk
        head, rest = data.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(rest) < length:
            rest += conn.recv(65536)
        return head

    def serve():
        for _ in range(4):  # per client: one connection that dies, then a new one
            conn, _ = listener.accept()
            with conn:
                if read_request(conn):
                    conn.sendall(reply)
                    answered.append(1)
                    read_request(conn)  # the next request arrives: close without answering

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with Client(url, timeout=10) as client:
            assert client.embed("a").tolist() == [1.0, 1.0]
            assert client.embed("b").tolist() == [1.0, 1.0]

        async def twice():
            async with AsyncClient(url, timeout=10) as client:
                return [(await client.embed(t)).tolist() for t in "ab"]

        assert asyncio.run(twice()) == [[1.0, 1.0]] * 2
        thread.join(10)
        assert len(answered) == 4
    finally:
        listener.close()


class Scripted:
    """An HTTP server that answers each request with the next (status, Retry-After) of a
    script (200: one vector), and counts them."""

    def __init__(self, *script):
        import http.server
        import threading

        self.script, self.seen = list(script), 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.do_GET()

            def do_GET(self):
                outer.seen += 1
                status, wait = outer.script.pop(0)
                body = msgpack.packb({"results": [np.ones(2, "<f4").tobytes()]} if status == 200
                                     else {"error": {"message": "busy", "type": "overloaded"}})
                self.send_response(status)
                self.send_header("Content-Type", "application/msgpack")
                self.send_header("Content-Length", str(len(body)))
                if wait is not None:
                    self.send_header("Retry-After", wait)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_refusal_before_any_work_is_sent_again_after_its_retry_after(asynchronous):
    """It raised at the first 429 or 503 (an outside check: the only client tried that did
    not retry them, and its error did not carry Retry-After)."""
    import asyncio

    def run(server, method="embed", **kwargs):
        args = ("a",) if method == "embed" else ()
        if not asynchronous:
            with Client(server.url, timeout=10, **kwargs) as client:
                return getattr(client, method)(*args)

        async def go():
            async with AsyncClient(server.url, timeout=10, **kwargs) as client:
                return await getattr(client, method)(*args)
        return asyncio.run(go())

    server = Scripted((429, "0"), (503, "0.01"), (200, None))
    try:
        assert run(server).tolist() == [1.0, 1.0] and server.seen == 3
        server.script, server.seen = [(429, "7")], 0
        with pytest.raises(ShmserveError) as info:
            run(server, max_retries=0)
        assert (info.value.status, info.value.retry_after, server.seen) == (429, 7.0, 1)
        server.script, server.seen = [(503, "0")] * 3, 0
        with pytest.raises(ShmserveError) as info:
            run(server)  # two retries, then the third answer is the error
        assert (info.value.status, server.seen) == (503, 3)
        server.script, server.seen = [(400, None)], 0
        with pytest.raises(ShmserveError) as info:
            run(server)  # refused for what it is: not sent again
        assert (info.value.status, info.value.retry_after, server.seen) == (400, None, 1)
        server.script, server.seen = [(503, "0")], 0
        assert run(server, "ready") is False and server.seen == 1  # not ready: say so at once
    finally:
        server.close()
    with pytest.raises(ValueError, match="max_retries"):
        Client("http://h", max_retries=-1)


def test_a_client_certificate_is_a_file_or_a_pair_of_files(tmp_path):
    """cert= (mutual TLS, nginx.tls_client_ca), as requests takes it; anything else, or files
    that cannot be presented, refused when the client is made."""
    import trustme

    from tests.pki import client_certificate

    cert, key = client_certificate(trustme.CA(), tmp_path, "alice")
    both = tmp_path / "both.pem"
    both.write_text(Path(cert).read_text() + Path(key).read_text())
    for given in (str(both), (cert, key), [cert, key]):
        Client("https://127.0.0.1:1", cert=given)  # loaded
    for bad in (123, (cert,), (cert, key, key), (cert, None)):
        with pytest.raises(ValueError, match="cert must be a PEM file's path or a"):
            Client("https://127.0.0.1:1", cert=bad)
    with pytest.raises(ValueError, match="cannot present it"):
        Client("https://127.0.0.1:1", cert=cert)  # a certificate without its key
