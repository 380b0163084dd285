"""A frontend's gRPC server (`server.grpc_port`): its life beside the aiohttp app (started in
its cleanup_ctx, drained first at a stop signal, its socket file swapped for one nobody listens
on) around the methods frontend.grpc_api serves."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import socket
import time
from pathlib import Path
from typing import AsyncIterator, Callable

import grpc
from aiohttp import web

from frontend import grpc_reflection
from frontend.app import CONFIG, INDEX
from frontend.grpc_api import Gateway, Unimplemented
from frontend.httpparser import nginx_size
from shmserve import topology
from shmserve.config import Config

log = logging.getLogger("shmserve.frontend")

GRPC_SERVER = web.AppKey("grpc_server", object)  # a GrpcServer, or None (server.grpc_port 0)


def socket_path(cfg: Config, index: int) -> str:
    return str(topology.frontend_grpc_socket(cfg, index))


# At a stop, after the socket file is gone: the calls on connections nginx opened before still
# arrive; the server stops once none has for QUIET_S (at most SETTLE_S).
QUIET_S = 0.1
SETTLE_S = 1.0


def refuse_at(path: str) -> None:
    """Put a socket file nobody listens on at `path`, in one rename: nginx's connects there are
    refused, which it logs as an error and passes the call to another frontend, where a missing
    file is logged at crit (alerts on crit fired at every rolling restart, as for the HTTP
    sockets: frontend.__main__.bind_in_place). grpc removes the file at its stop and binds over
    one at its start."""
    staging = os.path.join(os.path.dirname(path), f".{os.getpid()}.grpc")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(staging)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as placeholder:
        placeholder.bind(staging)
    os.replace(staging, path)


class GrpcServer:
    """A frontend's gRPC server. At a stop signal its calls drain first, while the HTTP socket
    they call still listens: its socket file is replaced by one nobody listens on (nginx's
    next connects are refused, and it passes those calls to another frontend), the calls on
    connections already open arrive, then the server stops (any later call refused; those
    running finish within server.drain_timeout_s). aiohttp's own drain follows, so a stop may
    take twice server.drain_timeout_s (shmserve.render.frontend_stopwaitsecs allows it). A
    stop that went straight to grpc's own (the socket file in place, no settling) answered
    CANCELLED to a call nginx had sent on a connection the server accepted just before: 1 of
    ~3,000 in a rolling restart under load."""

    def __init__(self, cfg: Config, index: int, app: web.Application) -> None:
        self._cfg = cfg
        self._path = socket_path(cfg, index)
        self._gateway = Gateway(cfg, app)
        # Messages up to the body nginx takes (nginx.client_max_body_size; 0: no limit);
        # answers of any size.
        limit = nginx_size(cfg.nginx.client_max_body_size) or -1
        self._server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", limit),
            # a compressed message is inflated by its deserializer, to `limit` at most
            # (grpc_messages.parser): grpc's own inflated a bomb whole before its size check
            ("grpc.per_message_decompression", 0),
            ("grpc.max_send_message_length", -1)])
        self._server.add_generic_rpc_handlers(
            [*self._gateway.handlers(limit), *grpc_reflection.handlers(), Unimplemented()])
        self._server.add_insecure_port("unix:" + self._path)
        self._stopping: asyncio.Future | None = None

    async def start(self) -> None:
        await self._server.start()

    @property
    def serving_at(self) -> Path | None:
        """Its socket file until its stop began (which replaces it: frontend.own_files)."""
        return Path(self._path) if self._stopping is None else None

    async def stop_calls(self) -> None:
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop_calls())
        await asyncio.shield(self._stopping)

    async def _stop_calls(self) -> None:
        refuse_at(self._path)
        settled = time.monotonic() + SETTLE_S
        while time.monotonic() < settled and time.monotonic() - self._gateway.last_call < QUIET_S:
            await asyncio.sleep(QUIET_S / 2)
        self._gateway.stopping.set()
        await self._server.stop(self._cfg.server.drain_timeout_s)
        refuse_at(self._path)  # grpc removed its socket file; the next start binds over this


async def serve(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: the gRPC server of a frontend, with server.grpc_port set."""
    cfg = app[CONFIG]
    server = GrpcServer(cfg, app[INDEX], app)
    await server.start()
    app[GRPC_SERVER] = server
    log.info("frontend.grpc_started", extra={"fields": {"socket": socket_path(cfg, app[INDEX])}})
    try:
        yield
    finally:
        await server.stop_calls()
        # grpc's aio shutdown runs when its last server is freed: left to the interpreter's
        # exit, it failed there and wrote "Error in sys.excepthook:" and two more lines of
        # text into the JSON log at every stop (grpc/grpc#38679). Freed here, while the loop
        # runs, it shuts down cleanly.
        app[GRPC_SERVER] = None
        del server
        gc.collect()


def stop_calls_then(app: web.Application, then: Callable[[], object]) -> None:
    """At a stop signal: drain the gRPC calls, then `then` (which starts aiohttp's drain); at
    once where the server has not started."""
    server = app.get(GRPC_SERVER)
    if server is None:
        then()
        return

    async def drain() -> None:
        try:
            await server.stop_calls()
        finally:
            then()

    asyncio.ensure_future(drain())
