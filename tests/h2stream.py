"""One HTTP/2 stream written by hand (the h2 library): what real clients will not send (headers
without their body, a grpc-encoding grpcio lacks, a malformed grpc-timeout)."""

from __future__ import annotations

import socket

import h2.config
import h2.connection
import h2.events


def exchange(sock: socket.socket, headers: list[tuple[str, str]],
             body: bytes | None) -> tuple[dict[str, str], bytes]:
    """Stream 1 on `sock`: `headers`, then `body` and the stream's end, or (None) nothing
    more, the stream left open for nginx to answer from the headers alone. The answer once its
    stream ends (or is reset): its headers and trailers as one dict, and its body."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(1, headers)
    if body is not None:
        conn.send_data(1, body, end_stream=True)
    sock.sendall(conn.data_to_send())
    got: dict[str, str] = {}
    answer = b""
    while True:
        data = sock.recv(65536)
        assert data, f"the connection closed before the answer ended: {got}"
        for event in conn.receive_data(data):
            if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                got.update((k.decode(), v.decode()) for k, v in event.headers)
            elif isinstance(event, h2.events.DataReceived):
                answer += event.data
            elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                return got, answer
        sock.sendall(conn.data_to_send())
