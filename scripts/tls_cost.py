#!/usr/bin/env python3
"""What a new connection costs under mutual TLS (nginx.tls_client_ca) against TLS alone.

Mutual TLS turns nginx's session cache off (shmserve.tls.session_lines: a resumed session kept
its certificate's first verification past a new CRL), so each new connection makes a full
handshake and presents its client certificate, where under TLS alone a client that keeps its
session resumes it. Two stacks of the config (--env, default dev; one frontend, one worker),
one each way, with certificates trustme issues (ECDSA P-256, as trustme makes them); each
round opens --connections connections one after another to each, a GET /health on each, the
client keeping its TLS session. Printed: each round's milliseconds a connection, the sessions
resumed, and the median of the mutual/plain ratios with their range. Kept-alive connections
pay neither handshake again.

  .venv/bin/python scripts/tls_cost.py                  # 5 rounds of 300 connections
  .venv/bin/python scripts/tls_cost.py --rounds 3 --connections 500
"""

from __future__ import annotations

import argparse
import socket
import ssl
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from benchkit import positive, spread  # noqa: E402
from benchmachine import cpu_description  # noqa: E402
from benchstacks import OwnStack, check_ports, require, run_main, stop_on_term  # noqa: E402


def certificates(files: Path) -> tuple[dict, dict, tuple[str, str], str]:
    """(nginx's keys for TLS alone, for mutual TLS, a client's certificate and key, the CA file
    clients trust for the server's certificate)."""
    import trustme

    server_ca, clients = trustme.CA(), trustme.CA()
    issued = server_ca.issue_cert("127.0.0.1", "localhost")
    for blob in issued.cert_chain_pems:
        blob.write_to_path(str(files / "chain.pem"), append=True)
    issued.private_key_pem.write_to_path(str(files / "key.pem"))
    server_ca.cert_pem.write_to_path(str(files / "ca.pem"))
    clients.cert_pem.write_to_path(str(files / "clients.pem"))
    client = clients.issue_cert("client@example.com", common_name="client")
    client.cert_chain_pems[0].write_to_path(str(files / "client.pem"))
    client.private_key_pem.write_to_path(str(files / "client.key"))
    plain = {"tls_certificate": str(files / "chain.pem"), "tls_key": str(files / "key.pem")}
    return (plain, {**plain, "tls_client_ca": str(files / "clients.pem")},
            (str(files / "client.pem"), str(files / "client.key")), str(files / "ca.pem"))


def per_connection(port: int, ca: str, cert: tuple[str, str] | None, count: int
                   ) -> tuple[float, int]:
    """(milliseconds a connection: connect, handshake, GET /health, close; sessions resumed)."""
    context = ssl.create_default_context(cafile=ca)
    if cert is not None:
        context.load_cert_chain(*cert)
    session, resumed = None, 0
    started = time.perf_counter()
    for _ in range(count):
        # The handshake inside the with: a Ctrl-C in it left the connection open (ssl closes a
        # socket whose handshake failed only on OSError), held by the traceback while the
        # stacks stopped, and nginx's graceful stop waited for it until SIGKILL (~15 s)
        with context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=30),
                                 server_hostname="127.0.0.1", session=session,
                                 do_handshake_on_connect=False) as conn:
            conn.do_handshake()
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            head = conn.recv(12)
            if head != b"HTTP/1.1 200":
                raise SystemExit(f"GET /health answered {head!r}")
            resumed += conn.session_reused
            session = conn.session
    return (time.perf_counter() - started) / count * 1000, resumed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default=None, help="the stacks' config env (default: dev)")
    parser.add_argument("--rounds", type=positive, default=5)
    parser.add_argument("--connections", type=positive, default=300)
    args = parser.parse_args()
    require("trustme")
    check_ports(2)
    stop_on_term()
    one = {"frontends": {"count": 1}, "workers": {"cpu_workers": 1}}
    with tempfile.TemporaryDirectory(prefix="shmserve-tls-cost-") as tmp:
        plain, mutual, client, ca = certificates(Path(tmp))
        with OwnStack(args.env, None, {**one, "nginx": plain}, label="TLS") as tls_alone, \
                OwnStack(args.env, None, {**one, "nginx": mutual}, label="mutual") as mtls:
            print(f"{cpu_description()}; {args.connections} connections a round, one after "
                  "another, each a GET /health", flush=True)
            ratios = []
            for index in range(args.rounds):
                alone, alone_resumed = per_connection(tls_alone.port, ca, None, args.connections)
                both, both_resumed = per_connection(mtls.port, ca, client, args.connections)
                ratios.append(both / alone)
                print(f"round {index + 1}: TLS {alone:.2f} ms a connection (resumed "
                      f"{alone_resumed}/{args.connections}), mutual TLS {both:.2f} ms (resumed "
                      f"{both_resumed}/{args.connections}): {both / alone:.2f}x", flush=True)
            print(f"mutual/TLS a new connection: median {spread(ratios, 'x')}")
    return 0


if __name__ == "__main__":
    run_main(main)
