"""One HTTP request answered by this frontend's own aiohttp application, in this process, without
a socket: how frontend.grpc_api runs each gRPC call through the HTTP routes.

The request goes through the whole application as one from nginx does (routing, the `observe`
middleware with its API keys, request id, metrics, access line and traces, then the route), so
a gRPC call gets what an HTTP one does from one implementation. What it skips is the transport:
an aiohttp client request over the frontend's unix socket, and the server's parsing of it,
cost ~0.25-0.4 ms of CPU a call against ~0.02 ms here (docs/protocols.md "Cost").

aiohttp has no public call for this: `Application._make_request` and `Application._handle` are
what its own connection handler (web_protocol.RequestHandler) calls for each parsed request.
aiohttp is pinned (constraints.txt); tests/unit/test_inprocess.py runs requests through a real
application, so an aiohttp whose internals moved fails there, not in a client's call.
"""

from __future__ import annotations

import asyncio

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11, RawRequestMessage
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

HOST = "frontend"  # the Host of every such request (a socket's requests had the client's own)


class _Connection:
    """What aiohttp's request and body stream ask of their connection: none of TLS, a peer or a
    socket address (the client's address is in nginx's X-Real-IP and X-Forwarded-For, which
    the caller passes on), and reading is never paused: the whole body is there already."""

    ssl_context = None
    peername = None
    sockname = None
    transport = None
    connected = True
    _reading_paused = False

    def pause_reading(self, **_) -> None:
        pass

    def resume_reading(self, **_) -> None:
        pass


def request(app: web.Application, method: str, path: str, body: bytes | None,
            headers: dict[str, str]) -> web.Request:
    """The request aiohttp would have made of these bytes arriving on the frontend's socket."""
    sent = CIMultiDict(headers)
    if hdrs.EXPECT in sent:
        raise ValueError("an in-process request takes no Expect header (it has no writer)")
    sent[hdrs.HOST] = HOST
    connection = _Connection()
    if body:
        sent[hdrs.CONTENT_LENGTH] = str(len(body))
        # high water past the body: feeding it whole never pauses a reader
        payload = StreamReader(connection, len(body) + 1, loop=asyncio.get_running_loop())
        payload.feed_data(body)
        payload.feed_eof()
    else:
        payload = EMPTY_PAYLOAD
    # as aiohttp's parser builds a request line's target: encoded as it came
    route, _, query = path.partition("?")
    message = RawRequestMessage(
        method, path, HttpVersion11, CIMultiDictProxy(sent),
        tuple((k.encode(), v.encode()) for k, v in sent.items()), False, None, False, False,
        URL.build(path=route, query_string=query, encoded=True))
    # No writer: every route answers a web.Response that the caller reads (none prepares a
    # stream), and an Expect header is refused above.
    return app._make_request(message, payload, connection, None, asyncio.current_task())


async def answer(app: web.Application, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None) -> tuple[int, CIMultiDict, bytes]:
    """(status, headers, body) of the application's answer to this request. Cancelled (the
    gRPC call gone), the route is cancelled with it, as a client's closed connection cancels
    an HTTP request's (its access line says client_closed)."""
    try:
        response = await app._handle(request(app, method, path, body, headers or {}))
    except web.HTTPException as exc:  # past any middleware: aiohttp's connection answers these
        return exc.status, CIMultiDict(exc.headers), (exc.text or "").encode()
    raw = response.body if isinstance(response, web.Response) else None
    if not isinstance(raw, bytes):  # a streamed answer, or a payload object: none of ours
        raise TypeError(f"{method} {path} answered {type(response).__name__} with a body of "
                        f"{type(raw).__name__}, not bytes")
    return response.status, response.headers, raw
