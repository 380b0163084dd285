"""Mutual TLS (nginx.tls_client_ca): nginx asks every client for a certificate on both ports;
a request without one is a 403 (gRPC: UNAUTHENTICATED) but on the probes, one whose certificate
another CA issued is refused everywhere; the CLI presents nginx.tls_client_certificate. Through
nginx and supervisord, with requests, the native client, tritonclient.grpc and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import numpy as np
import pytest
import requests
import trustme
from prometheus_client.parser import text_string_to_metric_families

from shmserve.client import Client, ShmserveError
from tests.conftest import tiny_overrides
from tests.pki import client_certificate, issue, revocations
from tests.stack import Stack, free_port

TOKEN = "mtls-admin-token"
APP = "https://app.example.com"


@pytest.fixture(scope="module")
def mtls(tmp_path_factory, tiny_model):
    """A stack asking for client certificates; the server's CA file, a certificate the
    clients' CA issued (alice) and one another CA issued (mallory)."""
    files = tmp_path_factory.mktemp("mtls")
    clients = trustme.CA()
    clients.cert_pem.write_to_path(str(files / "clients-ca.pem"))
    alice = client_certificate(clients, files, "alice")
    cli = client_certificate(clients, files, "shmserve-cli")
    mallory = client_certificate(trustme.CA(), files, "mallory")
    revoked = client_certificate(clients, files, "revoked")
    (files / "clients.crl").write_bytes(revocations(clients, [revoked[0]]))
    grpc_port = free_port()
    nginx = {**issue(files), "tls_client_ca": str(files / "clients-ca.pem"),
             "tls_client_crl": str(files / "clients.crl"),
             "tls_client_certificate": cli[0], "tls_client_key": cli[1],
             "cors_allow_origins": [APP]}
    stack = Stack(files / "stack", tiny_overrides(tiny_model, nginx=nginx,
                                                  admin={"token": TOKEN},
                                                  server={"grpc_port": grpc_port}))
    stack.grpc_port = grpc_port
    stack.up()  # `up --wait` polls /ready, which asks for no certificate
    try:
        stack.revoked = revoked
        yield stack, str(files / "ca.pem"), alice, mallory
    finally:
        stack.down()


def url(stack: Stack, path: str) -> str:
    return f"https://127.0.0.1:{stack.port}{path}"


def test_a_client_certificate_is_needed_everywhere_but_the_probes(mtls):
    stack, ca, alice, mallory = mtls
    body = {"input": ["a", "b"]}
    ok = requests.post(url(stack, "/v1/embeddings"), json=body, verify=ca, cert=alice,
                       headers={"X-Request-ID": "mtls-alice"}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["data"]) == 2, ok.text
    refused = requests.post(url(stack, "/v1/embeddings"), json=body, verify=ca, timeout=30,
                            headers={"X-Request-ID": "mtls-none"})
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["type"] == "forbidden"
    assert "asks for a client certificate" in refused.json()["error"]["message"]
    assert refused.headers["X-Request-ID"] == "mtls-none"
    # in the format the client asked for, and KServe's shape on its routes
    packed = requests.post(url(stack, "/predict"), data=msgpack.packb({"texts": ["a"]}),
                           verify=ca, timeout=30, headers={
                               "Content-Type": "application/msgpack",
                               "Accept": "application/msgpack"})
    assert packed.status_code == 403 and "client certificate" in msgpack.unpackb(
        packed.content)["error"]["message"]
    kserve = requests.post(url(stack, "/v2/models/tiny/infer"), json={"inputs": []}, verify=ca,
                           timeout=30)
    assert kserve.status_code == 403 and "client certificate" in kserve.json()["error"]
    for path in ("/metrics", "/admin/models", "/v1/models", "/openapi.json", "/info"):
        assert requests.get(url(stack, path), verify=ca, timeout=30).status_code == 403, path
    assert requests.get(url(stack, "/metrics"), verify=ca, cert=alice,
                        timeout=30).status_code == 200
    # the probes a kubelet sends without a certificate
    for path in ("/health", "/ready", "/v2/health/live", "/v2/health/ready",
                 "/v2/models/tiny/ready"):
        assert requests.get(url(stack, path), verify=ca, timeout=30).status_code == 200, path
    # a certificate another CA issued, or one the CA revoked (nginx.tls_client_crl): refused,
    # the probes too
    for path in ("/v1/embeddings", "/health"):
        for cert in (mallory, stack.revoked):
            forged = requests.post(url(stack, path), json=body, verify=ca, cert=cert, timeout=30)
            assert forged.status_code == 403, (path, cert, forged.text)
            assert "did not verify against nginx.tls_client_ca" in forged.json()[
                "error"]["message"]


@pytest.mark.parametrize("target", [
    "/v1/models/%2e%2e%2F%2e%2e%2Fhealth",  # nginx: /health; aiohttp: GET /v1/models/{model}
    "/v1/models/..%2F..%2Fhealth",
    "/v2/models/tiny/versions/%2e%2e%2F%2e%2e%2F%2e%2e%2F%2e%2e%2Fhealth",
    "/v2/models/tiny%2F%2e%2e%2F%2e%2e%2F%2e%2e%2Fhealth",
    "//health", "/./health", "/health/../v1/models",
    # nginx: /_shmserve_errorX, location / (the error pages' prefix once passed unchecked);
    # aiohttp: GET /v1/models/{model}, POST /admin/models/{name}/reload
    "/v1/models/%2e%2e%2F%2e%2e%2F_shmserve_errorX",
    "/admin/models/%2e%2e%2F%2e%2e%2F_shmserve_errorX/reload",
    "/_shmserve_errors", "/_shmserve_grpc_error/x"])
def test_a_target_nginx_reads_as_a_probe_but_the_frontend_does_not_needs_one(mtls, target):
    """The frontends get the request target as the client sent it: a probe only once nginx
    decoded it and resolved its dot segments is no probe to them (an outside check reached
    GET /v1/models/{model} without a certificate)."""
    import http.client
    import ssl

    stack, ca, _, _ = mtls
    connection = http.client.HTTPSConnection(
        "127.0.0.1", stack.port, timeout=30, context=ssl.create_default_context(cafile=ca))
    try:
        connection.request("POST" if target.endswith("/reload") else "GET", target)
        answer = connection.getresponse()
        body = answer.read()
    finally:
        connection.close()
    assert answer.status == 403 and b"asks for a client certificate" in body, (target, body)


def test_a_cors_preflight_needs_no_certificate_its_request_does(mtls):
    """A browser sends a preflight without its certificate; nginx answers it alone."""
    stack, ca, alice, _ = mtls
    asks = {"Origin": APP, "Access-Control-Request-Method": "POST"}
    preflight = requests.options(url(stack, "/v1/embeddings"), headers=asks, verify=ca,
                                 timeout=30)
    assert preflight.status_code == 204, preflight.text
    assert preflight.headers["Access-Control-Allow-Origin"] == APP
    assert requests.options(url(stack, "/admin/models"), headers=asks, verify=ca,
                            timeout=30).status_code == 403  # the frontends' route: refused
    for cert, status in ((None, 403), (alice, 200)):
        answer = requests.post(url(stack, "/v1/embeddings"), json={"input": "x"}, cert=cert,
                               headers={"Origin": APP}, verify=ca, timeout=30)
        assert answer.status_code == status, answer.text
        assert answer.headers["Access-Control-Allow-Origin"] == APP


def test_the_access_line_names_the_certificate_and_refusals_are_counted(mtls):
    stack, ca, alice, mallory = mtls
    for rid, cert in (("mtls-line-alice", alice), ("mtls-line-none", None),
                      ("mtls-line-mallory", mallory)):
        requests.post(url(stack, "/v1/embeddings"), json={"input": "x"}, verify=ca, cert=cert,
                      headers={"X-Request-ID": rid}, timeout=30)
    lines = {}

    def both() -> bool:
        lines.update({line["request_id"]: line for line in stack.log_lines("nginx")
                      if str(line.get("request_id", "")).startswith("mtls-line-")})
        return len(lines) == 3
    stack.wait_until(both, 10, "the three access lines")
    assert lines["mtls-line-alice"]["status"] == 200
    assert "CN=alice" in lines["mtls-line-alice"]["client_subject"], lines
    assert lines["mtls-line-alice"]["client_verify"] == "SUCCESS"
    assert lines["mtls-line-none"]["status"] == 403
    assert lines["mtls-line-none"]["client_subject"] == ""
    assert lines["mtls-line-none"]["client_verify"] == "NONE"
    assert lines["mtls-line-none"]["upstream_addr"] == ""  # no frontend saw it
    # a certificate that did not verify names no one (a self-signed CN=alice would)
    assert lines["mtls-line-mallory"]["status"] == 403
    assert lines["mtls-line-mallory"]["client_subject"] == ""
    # and why, which nginx's error log (warn) does not say: OpenSSL's reason
    assert lines["mtls-line-mallory"]["client_verify"].startswith("FAILED:"), lines

    def refused() -> float:
        text = requests.get(url(stack, "/metrics"), verify=ca, cert=alice, timeout=30).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "shmserve_nginx_responses_total"
                   and s.labels.get("status") == "403")
    stack.wait_until(lambda: refused() >= 1, 10, "nginx's 403s in /metrics")


def test_clients_present_their_certificate(mtls):
    stack, ca, alice, _ = mtls
    with Client(url(stack, ""), verify=ca, cert=alice) as client:
        assert client.embed(["a", "b"]).shape == (2, 32)
    with pytest.raises(ValueError, match="cannot present it"):
        Client(url(stack, ""), verify=ca, cert=(alice[0] + ".missing", alice[1]))
    with Client(url(stack, ""), verify=ca, max_retries=0) as anonymous:
        with pytest.raises(ShmserveError) as refused:
            anonymous.embed("a")
    assert refused.value.status == 403


def test_the_cli_presents_its_configured_certificate(mtls):
    stack, *_ = mtls
    about = json.loads(stack.cli("status", "--json").stdout)  # /metrics and /ready
    assert about["url"] == url(stack, ""), about
    models = stack.cli("models")  # an admin route, with admin.token
    assert json.loads(models.stdout)["models"][0]["name"] == "tiny"


def test_grpc_asks_for_the_certificate_too(mtls):
    import tritonclient.grpc as triton_grpc
    from tritonclient.utils import InferenceServerException

    stack, ca, alice, _ = mtls
    address = f"127.0.0.1:{stack.grpc_port}"
    tensor = triton_grpc.InferInput("text", [2], "BYTES")
    tensor.set_data_from_numpy(np.array([b"a", b"b"], dtype=object))
    with triton_grpc.InferenceServerClient(address, ssl=True, root_certificates=ca,
                                           certificate_chain=alice[0],
                                           private_key=alice[1]) as client:
        assert client.infer("tiny", [tensor]).as_numpy("embedding").shape == (2, 32)
    with triton_grpc.InferenceServerClient(address, ssl=True, root_certificates=ca) as anonymous:
        assert anonymous.is_server_live() and anonymous.is_model_ready("tiny")  # probes
        with pytest.raises(InferenceServerException) as refused:
            anonymous.infer("tiny", [tensor])
    assert refused.value.status() == "StatusCode.UNAUTHENTICATED", refused.value
    assert "asks for a client certificate" in refused.value.message()


@pytest.mark.parametrize("method", ["/_shmserve_grpc_errorX", "/_shmserve_grpc_error/x",
                                    "/_shmserve_errors"])
def test_grpc_the_error_pages_prefix_needs_a_certificate(mtls, method):
    """nginx's own error locations pass the certificate check (their internal redirects come
    back to it), a client's call under a look-alike path does not."""
    import grpc

    stack, ca, _, _ = mtls
    with open(ca, "rb") as file:
        credentials = grpc.ssl_channel_credentials(root_certificates=file.read())
    with grpc.secure_channel(f"127.0.0.1:{stack.grpc_port}", credentials) as channel:
        call = channel.unary_unary(method, request_serializer=lambda x: x,
                                   response_deserializer=lambda x: x)
        with pytest.raises(grpc.RpcError) as refused:
            call(b"", timeout=30)
    assert refused.value.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                    grpc.StatusCode.UNIMPLEMENTED), refused.value
    # nginx's 404 for its internal location (UNIMPLEMENTED), or its 403: never a frontend's
    assert "has no method" not in (refused.value.details() or ""), refused.value.details()


def test_no_tls_session_is_resumed_so_a_new_crl_holds_at_once(mtls):
    """A resumed session keeps its first handshake's verification, and nginx's session cache
    outlives a reload: a certificate revoked by a new CRL (`shmserve restart nginx`) kept
    getting 200s on resumed connections (an outside check, TLS 1.2 and 1.3). No cache under
    mutual TLS: every connection's certificate meets the CRL nginx read last."""
    import socket
    import ssl

    stack, ca, alice, _ = mtls
    for version in (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3):
        context = ssl.create_default_context(cafile=ca)
        context.load_cert_chain(*alice)
        context.minimum_version = context.maximum_version = version
        session = None
        for _ in range(2):
            with context.wrap_socket(socket.create_connection(("127.0.0.1", stack.port), 30),
                                     server_hostname="127.0.0.1", session=session) as conn:
                conn.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                assert conn.recv(12) == b"HTTP/1.1 200", version
                assert not conn.session_reused, version
                session = conn.session


def test_a_crl_broken_under_the_running_nginx_is_named_and_warned_of(mtls):
    """The CRL file broken since nginx read it: `restart nginx` refuses, naming the key and
    the file (it named nginx.conf), nginx serving on; `status` warns that a restarted nginx
    would not start (an outside check's nginx, killed then, stayed down, status saying
    nothing). Put right, both are quiet again."""
    stack, ca, alice, _ = mtls
    crl = Path(json.loads((stack.run_dir / "config.json").read_text())["nginx"]["tls_client_crl"])
    kept = crl.read_bytes()
    crl.write_text("-----BEGIN X509 CRL-----\nnot a CRL\n-----END X509 CRL-----\n")
    try:
        refused = stack.cli("restart", "nginx", check=False)
        assert refused.returncode == 2 and f"(check nginx.tls_client_crl ({crl}))" in \
            refused.stderr and "nginx was left as it runs" in refused.stderr, refused.stderr
        assert requests.get(url(stack, "/v1/models"), verify=ca, cert=alice,
                            timeout=30).status_code == 200
        shown = stack.cli("status", check=False)
        assert "would not start on them now" in shown.stderr and \
            f"nginx.tls_client_crl ({crl})" in shown.stderr, shown.stderr
        # another CA's CRL: nginx -t takes it, then refuses every client (an outside check)
        crl.write_bytes(revocations(trustme.CA(), []))
        refused = stack.cli("restart", "nginx", check=False)
        assert refused.returncode == 2 and "holds no CRL (that openssl reads) of a CA" in \
            refused.stderr, refused.stderr
        assert requests.get(url(stack, "/v1/models"), verify=ca, cert=alice,
                            timeout=30).status_code == 200
        shown = stack.cli("status", check=False)
        assert "holds no CRL (that openssl reads) of a CA" in shown.stderr, shown.stderr
    finally:
        crl.write_bytes(kept)
    assert "warning" not in stack.cli("status", check=False).stderr


def test_the_tls_files_dates_are_scraped_for_alerts(mtls):
    """shmserve_tls_expiry_timestamp_seconds (the reaper's, every minute): each TLS file's
    earliest end, what ShmserveTlsExpiring and ShmserveTlsExpired alert on."""
    from cryptography import x509

    stack, ca, alice, _ = mtls
    cfg = json.loads((stack.run_dir / "config.json").read_text())["nginx"]
    text = requests.get(url(stack, "/metrics"), verify=ca, cert=alice, timeout=30).text
    dates = {(s.labels["key"], s.labels["kind"]): s.value
             for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == "shmserve_tls_expiry_timestamp_seconds"}
    crl = x509.load_pem_x509_crl(Path(cfg["tls_client_crl"]).read_bytes())
    server = x509.load_pem_x509_certificates(Path(cfg["tls_certificate"]).read_bytes())
    assert dates == {
        ("nginx.tls_certificate", "certificate"):
            min(c.not_valid_after_utc.timestamp() for c in server),  # the chain's first end
        ("nginx.tls_client_ca", "certificate"): x509.load_pem_x509_certificate(Path(
            cfg["tls_client_ca"]).read_bytes()).not_valid_after_utc.timestamp(),
        ("nginx.tls_client_crl", "crl"): crl.next_update_utc.timestamp(),
        ("nginx.tls_client_certificate", "certificate"): x509.load_pem_x509_certificate(Path(
            cfg["tls_client_certificate"]).read_bytes()).not_valid_after_utc.timestamp()}
    refused = [s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "shmserve_nginx_start_refused"]
    assert refused == [0]  # nginx would start on them (ShmserveNginxWouldNotStart)
