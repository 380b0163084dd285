"""nginx's per-client limits as `shmserve up` renders them, with nothing (or a frozen
frontend) behind it: a request rate (nginx.rate_limit_per_s) and requests in flight
(nginx.max_requests_per_client), each past its limit a 429 in the error shape."""

from __future__ import annotations

import json

import msgpack
import pytest

from shmserve import render, topology
from tests.unit.test_nginx_pages import nginx_of, request
from tests.unit.test_render import make_config


@pytest.mark.parametrize("key", ["ip", "api_key"])
def test_a_client_past_the_rate_limit_gets_429_from_nginx(tmp_path, key):
    """nginx.rate_limit_per_s: past the rate (and the burst), 429 at once in the error shape
    and format every other page has, with Retry-After; probes are not limited; a client is its
    address or its bearer token. No frontend runs here: what passes the limit gets nginx's
    502."""
    cfg = make_config(tmp_path / "run", frontends={"count": 1},
                      nginx={"rate_limit_per_s": 1, "rate_limit_burst": 2,
                             "rate_limit_key": key}, auth={"api_keys": ["client-one"]})
    one = {"Authorization": "Bearer client-one"}
    with nginx_of(cfg):
        answers = [request(cfg, "POST", "/v1/embeddings", b"{}", one) for _ in range(6)]
        assert [status for status, _, _ in answers] == [502] * 3 + [429] * 3
        # The same key written otherwise (the frontends read "Bearer" in any case, spaces
        # around the token) is the same client; another key from the same address is its own
        # client with api_key, the same with ip, and so is a request without a key.
        for same in ("bearer client-one", "BEARER   client-one  ", "Bearer \tclient-one",
                     "Bearer \t \tclient-one\t"):
            assert request(cfg, "POST", "/v1/embeddings", b"{}",
                           {"Authorization": same})[0] == 429
        other = request(cfg, "POST", "/v1/embeddings", b"{}",
                        {"Authorization": "Bearer client-two"})[0]
        assert other == (502 if key == "api_key" else 429)
        keyless = [request(cfg, "POST", "/v1/embeddings", b"{}")[0] for _ in range(4)]
        assert keyless == ([502] * 3 + [429] if key == "api_key" else [429] * 4)
        _, headers, body = answers[-1]
        assert headers["Retry-After"] in ("1", "2") and headers["Content-Type"] == \
            "application/json"
        # Half say a second more (by nginx's random request id): a refused burst's retries
        # came back all at once, and were refused together again (an outside check)
        said = [request(cfg, "POST", "/v1/embeddings", b"{}", one)[1]["Retry-After"]
                for _ in range(24)]
        assert set(said) == {"1", "2"}, said  # (all alike: a chance of 2 in 2**24)
        assert json.loads(body)["error"]["type"] == "overloaded"
        assert "nginx.rate_limit_per_s" in json.loads(body)["error"]["message"]
        status, headers, body = request(cfg, "POST", "/predict", b"{}",
                                        {"Accept": "application/msgpack", **one})
        assert status == 429 and msgpack.unpackb(body)["error"]["type"] == "overloaded"
        status, _, body = request(cfg, "POST", "/v2/models/m/infer", b"{}", one)
        assert status == 429 and isinstance(json.loads(body)["error"], str)  # KServe's shape
        # Probes and scrapes are not limited, as written: a target nginx resolves into one is
        # counted (/v1/models/%2e%2e%2Fhealth is /health to nginx, GET /v1/models/{model} to a
        # frontend, which it reached past the limit)
        for path in ("/health", "/metrics", "/v2/models/m/ready", "/v2/models/m/versions/1/ready",
                     "/health?probe=1"):
            assert [request(cfg, "GET", path, None, one)[0] for _ in range(4)] == [502] * 4
        for crafted in ("/v1/models/%2e%2e%2F%2e%2e%2Fhealth", "/v1/models/..%2F..%2Fmetrics",
                        "//health", "/v2/models/m%2Fready", "/v2/models/m/infer?/ready",
                        "/v2/models/m?/ready", "/v2/models/m/infer#/ready"):
            assert request(cfg, "GET", crafted, None, one)[0] == 429, crafted
        # On 429s, and 502s and 503s (no frontend answered: a restart of them all, say).
        assert request(cfg, "GET", "/ready")[1]["Retry-After"] == "1"
        status, headers, _ = request(cfg, "TRACE", "/ready")
        assert status == 405 and "Retry-After" not in headers
        assert headers["Allow"] == "GET, HEAD, POST, PUT"  # no CORS here: no OPTIONS
    # A client over its rate is not logged (at error, alerts fired; a flood was a line per
    # 429): shmserve_nginx_responses_total{status="429"} counts them.
    refusals = [line for line in (topology.log_dir(cfg) / "nginx.log").read_text().splitlines()
                if "limiting requests" in line]
    assert not refusals, refusals[:3]
    assert "limit_req_log_level info;" in render.nginx_conf(cfg).read_text()


def test_a_rate_under_one_a_second_is_kept_per_minute_and_its_429_says_when_to_retry(tmp_path):
    """nginx.rate_limit_per_s 0.5: one request every 2 s (nginx's 30r/m), Retry-After 2 (3 for
    half the refusals)."""
    cfg = make_config(tmp_path / "run", frontends={"count": 1},
                      nginx={"rate_limit_per_s": 0.5})
    with nginx_of(cfg):
        first, second = (request(cfg, "POST", "/v1/embeddings", b"{}") for _ in range(2))
        assert first[0] == 502 and second[0] == 429  # no frontend runs: passed, refused
        assert second[1]["Retry-After"] in ("2", "3")
    assert "rate=30r/m;" in render.nginx_conf(cfg).read_text()


def test_a_client_past_its_requests_in_flight_gets_429_from_nginx(tmp_path):
    """nginx.max_requests_per_client: with that many of a client's requests in flight (here
    held by a frontend that never answers), its next one is refused at once, 429 in the error
    shape with its own message and Retry-After 1; another client (its API key) and the probes
    are not held back by it. Not logged (a flood of refusals was a line each)."""
    import socket
    import time

    cfg = make_config(tmp_path / "run", frontends={"count": 1},
                      nginx={"max_requests_per_client": 2, "rate_limit_key": "api_key",
                             "probe_timeout_s": 1}, auth={"api_keys": ["client-one"]})
    frozen = socket.socket(socket.AF_UNIX)

    def listen():  # the kernel accepts for it; nobody reads
        frozen.bind(str(topology.frontend_socket(cfg, 0)))
        frozen.listen(64)

    def sent(token: str) -> socket.socket:
        held = socket.create_connection(("127.0.0.1", cfg.server.port), timeout=10)
        held.sendall(f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     f"{token}\r\nContent-Length: 2\r\n\r\n{{}}".encode())
        return held

    one = {"Authorization": "Bearer client-one"}
    held = []
    with nginx_of(cfg, listen):
        try:
            held += [sent("client-one"), sent("client-one")]
            time.sleep(0.5)  # both proxied (nginx counts a request once it has its headers)
            began = time.monotonic()
            status, headers, body = request(cfg, "POST", "/v1/embeddings", b"{}", one)
            assert time.monotonic() - began < 0.5  # refused at once, not held
            assert status == 429 and headers["Retry-After"] in ("1", "2"), (status, body)
            error = json.loads(body)["error"]
            assert error["type"] == "overloaded" and "nginx.max_requests_per_client" in \
                error["message"], error
            status, _, body = request(cfg, "POST", "/predict", b"{}",
                                      {"Accept": "application/msgpack", **one})
            assert status == 429 and "max_requests_per_client" in \
                msgpack.unpackb(body)["error"]["message"]
            status, _, body = request(cfg, "POST", "/v2/models/m/infer", b"{}", one)
            assert status == 429 and "max_requests_per_client" in json.loads(body)["error"]
            # another client's requests, and a probe, go on to the (frozen) frontend
            held += [sent("client-two"), sent("client-two")]
            time.sleep(0.5)
            for each in held[2:]:
                each.settimeout(0.3)
                with pytest.raises(socket.timeout):  # held, not refused
                    each.recv(1)
            assert request(cfg, "GET", "/health", None, one)[0] in (502, 504)  # not 429
        finally:  # before nginx's graceful stop, which waits for the requests it holds
            frozen.close()  # (its queued connections reset: nginx answers them 502)
            for each in held:
                each.close()
    conf = render.nginx_conf(cfg).read_text()
    assert "limit_conn shmserve_inflight_api_key 2;" in conf and "limit_req " not in conf
    refusals = [line for line in (topology.log_dir(cfg) / "nginx.log").read_text().splitlines()
                if "limiting connections" in line]
    assert not refusals, refusals[:3]
