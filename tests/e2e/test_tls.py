"""TLS on the deployment's port (nginx.tls_certificate, nginx.tls_key): HTTPS and HTTP/2
through nginx with the clients users have, the CLI's own calls through the port, and plain
HTTP on it answered in the error shape."""

from __future__ import annotations

import json
import socket
import ssl

import httpx
import msgpack
import numpy as np
import pytest
import requests
import trustme
from openai import OpenAI

from shmserve.client import Client, ShmserveError
from tests import h2stream
from tests.conftest import tiny_overrides
from tests.e2e.test_apply import edit
from tests.pki import client_certificate, issue
from tests.stack import Stack, free_port


@pytest.fixture(scope="module")
def tls(tmp_path_factory, tiny_model):
    """A stack serving HTTPS, and the CA's file."""
    files = tmp_path_factory.mktemp("tls")
    grpc_port = free_port()
    stack = Stack(files / "stack", tiny_overrides(tiny_model, nginx=issue(files),
                                                  server={"grpc_port": grpc_port}))
    stack.grpc_port = grpc_port
    stack.up()  # `up --wait` polls /ready through the port: over TLS now
    try:
        yield stack, str(files / "ca.pem")
    finally:
        stack.down()


def https(stack: Stack) -> str:
    return f"https://127.0.0.1:{stack.port}"


def test_tritonclient_grpc_over_tls_on_the_grpc_port(tls):
    """gRPC (server.grpc_port) takes the same certificate: TLS with HTTP/2 by ALPN."""
    import tritonclient.grpc as triton_grpc

    stack, ca = tls
    with triton_grpc.InferenceServerClient(f"127.0.0.1:{stack.grpc_port}", ssl=True,
                                           root_certificates=ca) as client:
        assert client.is_server_ready()
        tensor = triton_grpc.InferInput("text", [2], "BYTES")
        tensor.set_data_from_numpy(np.array([b"a", b"b"], dtype=object))
        got = client.infer("tiny", [tensor]).as_numpy("embedding")
    assert got.shape == (2, 32)
    with triton_grpc.InferenceServerClient(f"127.0.0.1:{stack.grpc_port}") as plain:
        with pytest.raises(Exception, match="UNAVAILABLE"):  # cleartext h2 on the TLS port
            plain.is_server_ready(client_timeout=10)


def test_requests_and_the_openai_client_embed_over_https(tls):
    stack, ca = tls
    answer = requests.post(f"{https(stack)}/v1/embeddings", json={"input": ["a", "b"]},
                           verify=ca, timeout=30)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["data"]) == 2 and answer.headers["X-Request-ID"]
    with httpx.Client(verify=ssl.create_default_context(cafile=ca)) as http_client:
        client = OpenAI(base_url=f"{https(stack)}/v1", api_key="unused", http_client=http_client)
        vectors = client.embeddings.create(model="tiny", input=["a", "b"]).data
    assert np.allclose(vectors[0].embedding, answer.json()["data"][0]["embedding"], atol=1e-6)
    # a client that does not trust the test CA is refused at the handshake
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(f"{https(stack)}/health", timeout=30)


def test_http2_is_offered_and_serves_every_format(tls):
    stack, ca = tls
    with httpx.Client(http2=True, verify=ssl.create_default_context(cafile=ca),
                      base_url=https(stack), timeout=30) as client:
        answer = client.post("/v1/embeddings", json={"input": "over h2"})
        assert answer.http_version == "HTTP/2" and answer.status_code == 200, answer.text
        packed = client.post("/predict", content=msgpack.packb({"texts": ["x", "y"]}),
                             headers={"Content-Type": "application/msgpack",
                                      "Accept": "application/msgpack"})
        assert packed.status_code == 200 and packed.http_version == "HTTP/2"
        # nginx's own error pages too: an unknown route, a body over the limit
        missing = client.get("/no/such/route")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"
    # a body over nginx.client_max_body_size over HTTP/2 (h2 itself: httpx waits for the flow
    # window of a body nginx no longer reads): nginx's HTML page was answered, not this one
    status, headers, body = h2_request(stack, ca, [("content-type", "application/json"), (
        "content-length", str(9 << 20))])
    assert status == 413 and headers["content-type"] == "application/json", body
    assert json.loads(body)["error"]["type"] == "too_large"
    # nginx measures an HTTP/2 field HPACK-encoded: 20,000 'a's (5 bits each) pass it, and the
    # frontend's parser answered them 400 "malformed HTTP request" (HTTP/1.1: nginx's 431/414)
    with httpx.Client(http2=True, verify=ssl.create_default_context(cafile=ca),
                      base_url=https(stack), timeout=30) as client:
        long_header = client.get("/health", headers={"X-Long": "a" * 20000})
        long_path = client.get("/health?" + "a" * 20000)
    assert long_header.status_code == 200 and long_path.status_code == 200, long_path.text


def h2_request(stack: Stack, ca: str, headers: list[tuple[str, str]]
               ) -> tuple[int, dict[str, str], bytes]:
    """A POST /v1/embeddings over HTTP/2 whose headers alone go: (status, headers, body)."""
    context = ssl.create_default_context(cafile=ca)
    context.set_alpn_protocols(["h2"])
    with context.wrap_socket(socket.create_connection(("127.0.0.1", stack.port), timeout=30),
                             server_hostname="127.0.0.1") as sock:
        assert sock.selected_alpn_protocol() == "h2"
        got, body = h2stream.exchange(sock, [(":method", "POST"), (":path", "/v1/embeddings"),
                                             (":scheme", "https"), (":authority", "127.0.0.1"),
                                             *headers], None)
    return int(got[":status"]), got, body


def test_plain_http_on_the_tls_port_is_told_to_use_https(tls):
    stack, _ = tls
    with socket.create_connection(("127.0.0.1", stack.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nAccept: application/json\r\n"
                     b"Connection: close\r\n\r\n")
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), raw
    error = json.loads(body)["error"]
    assert error["type"] == "bad_request" and "https://" in error["message"], error


def test_the_native_client_checks_the_servers_certificate(tls):
    stack, ca = tls
    with Client(https(stack), verify=ca, format="msgpack") as client:
        assert client.embed(["a", "b"]).shape[0] == 2
    with Client(https(stack), max_retries=0) as untrusting:  # the system's CAs only
        with pytest.raises(ShmserveError, match="CERTIFICATE_VERIFY_FAILED"):
            untrusting.embed("a")


def test_the_cli_reaches_its_deployment_over_tls(tls):
    stack, _ = tls
    status = stack.cli("status", "--json")
    about = json.loads(status.stdout)
    assert about["url"] == https(stack), about
    assert status.returncode == 0


def test_an_apply_turns_tls_on_and_off_and_says_the_scheme_changed(tmp_path, tiny_model):
    """nginx reloads into HTTPS on the same port, and back; the apply warns that clients of the
    old scheme lose it, as it warns of a new address."""
    stack = Stack(tmp_path / "stack", tiny_overrides(tiny_model, admin={"token": "tls-admin"}))
    stack.up()
    try:
        plain, secure = stack.url, https(stack)
        # an encrypted key is refused by the dry run too (only the real apply refused it)
        locked = tmp_path / "locked.pem"
        locked.write_text("-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n"
                          "-----END ENCRYPTED PRIVATE KEY-----\n")
        files = issue(tmp_path)
        edit(stack, nginx={**files, "tls_key": str(locked)})
        dry = stack.cli("apply", "--dry-run", "--move", check=False)
        assert dry.returncode == 2 and "locked.pem is encrypted" in dry.stderr, dry.stderr
        edit(stack, nginx=files)
        done = stack.cli("apply", "--move", timeout=300)
        assert "reload its configuration: nginx" in done.stdout, done.stdout
        assert f"warning: nginx moves from {plain} to {secure}: clients of the old scheme get " \
            "a 400 (plain HTTP on the TLS port)" in done.stderr, done.stderr
        answer = requests.post(f"{secure}/v1/embeddings", json={"input": "x"},
                               verify=str(tmp_path / "ca.pem"), timeout=30)
        assert answer.status_code == 200, answer.text
        assert requests.get(f"{plain}/health", timeout=30).status_code == 400
        assert stack.cli("status").returncode == 0  # over TLS now
        # mutual TLS on: nginx reloads, no frontend or worker restarts (the reaper does: it
        # reads the TLS files' dates), the apply says who is refused now
        clients = trustme.CA()
        clients.cert_pem.write_to_path(str(tmp_path / "clients.pem"))
        alice = client_certificate(clients, tmp_path, "alice")
        edit(stack, nginx={**files, "tls_client_ca": str(tmp_path / "clients.pem")})
        done = stack.cli("apply", timeout=300)
        assert "reload its configuration: nginx" in done.stdout, done.stdout
        assert "restart: reaper" in done.stdout and "restart" not in done.stdout.replace(
            "restart: reaper", "").replace("reaper restarted", ""), done.stdout
        assert "nginx asks clients for a certificate" in done.stderr, done.stderr
        for cert, status in ((None, 403), (alice, 200)):
            answer = requests.post(f"{secure}/v1/embeddings", json={"input": "x"}, cert=cert,
                                   verify=str(tmp_path / "ca.pem"), timeout=30)
            assert answer.status_code == status, answer.text
        # the CLI, given no certificate to present, says what to set
        models = stack.cli("models", check=False)
        assert models.returncode == 2 and "set nginx.tls_client_certificate" in models.stderr
        reload = stack.cli("reload", "tiny", check=False)  # without "reloading ...; waiting"
        assert reload.returncode == 2 and "waiting" not in reload.stderr, reload.stderr
        assert "set nginx.tls_client_certificate" in reload.stderr
        edit(stack, nginx={**files, "tls_client_ca": ""})  # off again: said too
        done = stack.cli("apply", timeout=300)
        assert "nginx asks clients for no certificate from now on" in done.stderr, done.stderr
        assert requests.post(f"{secure}/v1/embeddings", json={"input": "x"}, timeout=30,
                             verify=str(tmp_path / "ca.pem")).status_code == 200
        edit(stack, nginx={"tls_certificate": "", "tls_key": ""})
        done = stack.cli("apply", "--move", timeout=300)
        assert f"warning: nginx moves from {secure} to {plain}: clients of the old scheme get " \
            "a failed TLS handshake" in done.stderr, done.stderr
        assert requests.get(f"{plain}/health", timeout=30).status_code == 200
    finally:
        stack.down()
