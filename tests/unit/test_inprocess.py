"""frontend.inprocess: a request answered by an aiohttp application in process is the request
that application gets over a socket (what the gRPC gateway relies on). Each test asks a real
application both ways and compares; an aiohttp whose internals moved fails here."""

from __future__ import annotations

import asyncio
import gzip

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from frontend import inprocess
from frontend.codec import read_raw

SEEN = web.AppKey("seen", list)


async def echo(request: web.Request) -> web.Response:
    body = await read_raw(request)  # the frontend's own reader: Content-Encoding, the limit
    return web.json_response({
        "method": request.method, "path": request.path, "raw_path": request.raw_path,
        "query": dict(request.query), "match": dict(request.match_info),
        "key": request.headers.get("Authorization"), "id": request.headers.get("X-Request-ID"),
        "host": request.host, "body": body.decode()},
        headers={"X-Echo": "1", "Retry-After": "2"}, status=201)


async def slow(request: web.Request) -> web.Response:
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        request.app[SEEN].append("cancelled")
        raise
    return web.Response(text="late")


@web.middleware
async def named(request: web.Request, handler) -> web.StreamResponse:
    try:
        response = await handler(request)
    except web.HTTPException as exc:  # as frontend.app.observe: routing's 404 and 405, a 413
        response = web.json_response({"error": exc.reason}, status=exc.status)
    response.headers["X-Seen-By"] = "middleware"
    return response


def application(middleware: bool = True) -> web.Application:
    app = web.Application(middlewares=[named] if middleware else [], client_max_size=1000)
    app[SEEN] = []
    app.router.add_route("*", "/v2/models/{model:.+}/infer", echo)
    app.router.add_get("/slow", slow)
    return app


async def both(app: web.Application, method: str, path: str, body: bytes | None = None,
               headers: dict[str, str] | None = None):
    """(in process, over a socket): each (status, the headers both set, body). In process
    while the application serves (started, so frozen), as the frontend's gRPC server runs."""
    server = TestServer(app)
    # as the frontends run (frontend.__main__): Content-Encoding is read by codec.read_raw
    await server.start_server(auto_decompress=False)
    async with TestClient(server) as client:
        here = await inprocess.answer(app, method, path, body, headers)
        # the Host the gateway's socket requests had (and its in-process ones have)
        sent = {**(headers or {}), "Host": inprocess.HOST}
        async with client.request(method, path, data=body, headers=sent,
                                  skip_auto_headers=("User-Agent",)) as response:
            there = response.status, response.headers, await response.read()
    names = [name for name in there[1] if name.lower().startswith(("x-", "retry-after"))]
    pick = lambda answer: (answer[0], {n: answer[1].get(n) for n in names}, answer[2])  # noqa: E731
    return pick(here), pick(there)


async def test_a_request_reaches_the_route_as_it_does_over_a_socket():
    app = application()
    here, there = await both(app, "POST", "/v2/models/org/m%20x/infer?a=1&b=%C3%A9", b"hello",
                             {"Authorization": "Bearer k", "X-Request-ID": "r1"})
    assert here == there
    status, headers, body = here
    assert status == 201 and headers == {"X-Echo": "1", "X-Seen-By": "middleware",
                                         "Retry-After": "2"}
    sent = orjson.loads(body)
    assert sent["match"] == {"model": "org/m x"} and sent["query"] == {"a": "1", "b": "é"}
    assert sent["body"] == "hello" and sent["key"] == "Bearer k" and sent["id"] == "r1"
    assert sent["method"] == "POST" and sent["raw_path"].startswith("/v2/models/org/m%20x/")


async def test_a_get_without_a_body_and_a_compressed_body_are_read_alike():
    app = application()
    here, there = await both(app, "GET", "/v2/models/m/infer")
    assert here == there and orjson.loads(here[2])["body"] == ""
    here, there = await both(app, "POST", "/v2/models/m/infer", gzip.compress(b"inflated"),
                             {"Content-Encoding": "gzip"})
    assert here == there and orjson.loads(here[2])["body"] == "inflated"


@pytest.mark.parametrize("middleware", [True, False])
async def test_routing_errors_and_the_body_limit_answer_as_over_a_socket(middleware):
    app = application(middleware)
    for method, path, body in (("GET", "/nowhere", None), ("DELETE", "/slow", None),
                               ("POST", "/v2/models/m/infer", b"x" * 1001)):
        here, there = await both(app, method, path, body)
        assert here[0] == there[0] == {"/nowhere": 404, "/slow": 405}.get(path, 413)
        assert here[1] == there[1]
        if middleware:
            assert here[2] == there[2]


async def test_a_cancelled_call_cancels_its_route():
    app = application()
    async with TestClient(TestServer(app)):
        call = asyncio.create_task(inprocess.answer(app, "GET", "/slow"))
        await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    assert app[SEEN] == ["cancelled"]


async def test_an_expect_header_is_refused_rather_than_written_to_no_connection():
    with pytest.raises(ValueError, match="Expect"):
        await inprocess.answer(application(), "POST", "/v2/models/m/infer", b"x",
                               {"expect": "100-continue"})
