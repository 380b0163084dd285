"""KServe v2 / Open Inference Protocol over gRPC (`server.grpc_port`): what tritonclient.grpc
and KServe's gRPC clients speak, and gRPC health checking for Kubernetes' gRPC probes.

    client ──gRPC (HTTP/2)──▶ nginx :grpc_port ──grpc_pass──▶ frontend-N.grpc.sock (this module)
                                                                │ one HTTP request per call,
                                                                ▼ in process (frontend.inprocess)
                                              the frontend's own aiohttp application: the /v2
                                              routes (frontend.kserve)

Each frontend runs a grpc.aio server beside its aiohttp one, on the same event loop, and turns
every call into the matching KServe v2 HTTP request, which its own application answers in
process (ModelInfer into a POST .../infer with Triton's binary tensor extension, both ways).
So a gRPC call gets what an HTTP one does, from one implementation: API keys, admission,
priorities, A/B arms and pinned versions, metrics, the access line, request ids, traces.
It went over the frontend's unix socket until the fifty-second session (docs/protocols.md
measures both).

Services: inference.GRPCInferenceService's ServerLive, ServerReady, ModelReady,
ServerMetadata, ModelMetadata, ModelConfig, ModelStatistics, RepositoryIndex,
RepositoryModelLoad, RepositoryModelUnload (refused), ModelInfer and ModelStreamInfer
(frontend/protos/kserve.proto); grpc.health.v1.Health's Check; server reflection
(frontend.grpc_reflection). Any other method is gRPC's UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

import grpc
import orjson
from aiohttp import web

from frontend import inprocess, metrics, protos
from frontend.app import REQUEST_ID_MAX
from frontend.grpc_messages import (MISSING, STATUS_CODES, CallFailed, Undecodable, error_text,
                                    infer_body, infer_response, model_path, parser)
from frontend.kserve import HEADER_LENGTH
from shmserve.config import Config

log = logging.getLogger("shmserve.frontend")

# gRPC metadata a call carries on to its HTTP request: nginx's request id and the client's
# address (grpc_set_header), the API key, the client's name, a trace's context.
FORWARDED = ("x-request-id", "x-real-ip", "x-forwarded-for", "x-forwarded-proto",
             "authorization", "user-agent", "traceparent", "tracestate",
             # the HTTP routes' own deadline and priority headers, as metadata
             "x-request-timeout", "x-priority")
# The answer's headers a call returns as metadata (lower case, as gRPC wants it): the request id
# and the stage times, the revision and A/B arm that answered, Retry-After of a 429 or 503.
RETURNED_PREFIXES = ("x-", "retry-after")
HEALTHY_SERVICES = ("", protos.KSERVE_SERVICE)


class Gateway:
    """The gRPC methods, each one HTTP request answered by `app`, this frontend's application."""

    def __init__(self, cfg: Config, app: web.Application) -> None:
        self._app = app
        self._inflight = cfg.frontends.max_inflight
        self.last_call = 0.0  # time.monotonic() of the latest call's start (grpc_server's stop)
        self.stopping = asyncio.Event()  # set at a stop: open streams end (model_stream_infer)

    async def _call(self, context: grpc.aio.ServicerContext, method: str, path: str,
                    body: bytes | None = None, headers: dict[str, str] | None = None,
                    ok: tuple[int, ...] = (200,)) -> tuple[int, dict[str, str], bytes]:
        """One HTTP request for `context`'s call: (status, headers, body) of an answer whose
        status is in `ok`, else CallFailed. No limit on calls at once here: the frontend's
        admission (frontends.max_inflight) bounds them, with its 429s, as it does nginx's."""
        self.last_call = time.monotonic()
        sent = {key: value for key, value in context.invocation_metadata() or ()
                if key in FORWARDED and isinstance(value, str)}
        sent.update(headers or {})
        status, got, raw = await inprocess.answer(self._app, method, path, body, sent)
        metadata = tuple((key.lower(), value) for key, value in got.items()
                         if key.lower().startswith(RETURNED_PREFIXES))
        if status not in ok:
            raise CallFailed(STATUS_CODES.get(status, grpc.StatusCode.INTERNAL),
                             error_text(raw, status), metadata)
        await context.send_initial_metadata(metadata)
        return status, dict(got), raw

    async def _json(self, context, path: str, ok: tuple[int, ...] = (200,)
                    ) -> tuple[int, dict[str, Any]]:
        status, _, raw = await self._call(context, "GET", path, ok=ok)
        return status, orjson.loads(raw)

    # --- inference.GRPCInferenceService ---

    async def server_live(self, request, context):
        _, body = await self._json(context, "/v2/health/live")
        return protos.ServerLiveResponse(live=bool(body.get("live")))

    async def server_ready(self, request, context):
        status, _ = await self._json(context, "/v2/health/ready", ok=(200, 400))
        return protos.ServerReadyResponse(ready=status == 200)

    async def model_ready(self, request, context):
        # An unknown model is not ready, as Triton answers it, not NOT_FOUND (a name longer
        # than any model's too: recheck49).
        try:
            path = model_path(request, "/ready")
        except CallFailed as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            return protos.ModelReadyResponse(ready=False)
        status, _ = await self._json(context, path, ok=(200, 400, 404))
        return protos.ModelReadyResponse(ready=status == 200)

    async def server_metadata(self, request, context):
        _, body = await self._json(context, "/v2")
        return protos.ServerMetadataResponse(name=body["name"], version=body["version"],
                                             extensions=body["extensions"])

    async def model_metadata(self, request, context):
        _, body = await self._json(context, model_path(request))
        tensor = protos.ModelMetadataResponse.TensorMetadata
        return protos.ModelMetadataResponse(
            name=body["name"], versions=body["versions"], platform=body["platform"],
            inputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"])
                    for t in body["inputs"]],
            outputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"])
                     for t in body["outputs"]])

    async def model_config(self, request, context):
        from google.protobuf import json_format

        _, body = await self._json(context, model_path(request, "/config"))
        config = json_format.ParseDict(body, protos.ModelConfig(), ignore_unknown_fields=True)
        return protos.ModelConfigResponse(config=config)

    async def model_statistics(self, request, context):
        from google.protobuf import json_format

        if not request.name and request.version:
            raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT,
                             "a version needs its model's name")
        _, body = await self._json(context, model_path(request, "/stats") if request.name
                                   else "/v2/models/stats")
        return json_format.ParseDict(body, protos.ModelStatisticsResponse(),
                                     ignore_unknown_fields=True)

    async def repository_index(self, request, context):
        _, _, raw = await self._call(context, "POST", "/v2/repository/index",
                                     body=orjson.dumps({"ready": request.ready}),
                                     headers={"Content-Type": "application/json"})
        index = protos.RepositoryIndexResponse.ModelIndex
        return protos.RepositoryIndexResponse(models=[index(**entry)
                                                      for entry in orjson.loads(raw)])

    async def repository_model_load(self, request, context):
        await self._call(context, "POST", model_path(
            request, "/load", name=request.model_name, version="", under="/v2/repository"))
        return protos.RepositoryModelLoadResponse()

    async def repository_model_unload(self, request, context):
        await self._call(context, "POST", model_path(
            request, "/unload", name=request.model_name, version="", under="/v2/repository"))
        return protos.RepositoryModelUnloadResponse()

    async def model_infer(self, request, context):
        header, tail = infer_body(request, context.time_remaining())
        _, got, raw = await self._call(
            context, "POST", model_path(request, "/infer", name=request.model_name,
                                         version=request.model_version),
            body=header + tail,
            headers={"Content-Type": "application/octet-stream",
                     HEADER_LENGTH: str(len(header))})
        return infer_response(got, raw)

    async def model_stream_infer(self, requests, context):
        """Each request of the stream runs as it arrives, up to frontends.max_inflight at once
        (past that the stream is not read: HTTP/2's flow control holds the client back); its
        answer (or its error, as error_message, the stream going on) is written when it is
        done, in that order, as Triton's stream does: a response's id says which request it
        answers. A stream that ends (the client gone, cancelled) cancels its requests. When the
        frontend stops, a stream reads no more requests, answers those it read, and ends
        UNAVAILABLE (gRPC's status to retry: a new stream reaches another frontend)."""
        lock = asyncio.Lock()
        slots = asyncio.Semaphore(self._inflight)
        running: set[asyncio.Task] = set()
        sequence = 0

        async def one(request, number: int) -> None:
            # An error's answer names its request too (infer_response's id and model), so a
            # client that sent many can tell which failed (tritonclient reads error_message).
            failed = protos.ModelInferResponse() if isinstance(request, Undecodable) else \
                protos.ModelInferResponse(id=request.id, model_name=request.model_name)
            try:
                if isinstance(request, Undecodable):
                    raise CallFailed(request.code, request.message)
                reply = protos.ModelStreamInferResponse(
                    infer_response=await self.model_infer(request, _StreamCall(context, number)))
            except CallFailed as exc:
                reply = protos.ModelStreamInferResponse(error_message=exc.message,
                                                        infer_response=failed)
            except Exception:
                log.exception("frontend.grpc_error", extra={"fields": {
                    "method": "model_stream_infer"}})
                reply = protos.ModelStreamInferResponse(
                    error_message="internal error (logged by the frontend)",
                    infer_response=failed)
            finally:
                slots.release()
            async with lock:
                await context.write(reply)

        reader = requests.__aiter__()
        stopping = asyncio.ensure_future(self.stopping.wait())
        following: asyncio.Future | None = None
        try:
            while True:
                following = asyncio.ensure_future(reader.__anext__())
                await asyncio.wait((following, stopping), return_when=asyncio.FIRST_COMPLETED)
                if not following.done():  # the frontend stopping: no more requests read
                    following.cancel()
                    break
                try:
                    request = following.result()
                except StopAsyncIteration:
                    break
                await slots.acquire()
                sequence += 1
                task = asyncio.create_task(one(request, sequence))
                running.add(task)
                task.add_done_callback(running.discard)
            if running:
                await asyncio.gather(*running)
            if self.stopping.is_set():
                # A stream would hold the stop for the whole drain, then be cut (an outside
                # check: a rolling restart took 23 s instead of 6 with two streams open).
                raise CallFailed(grpc.StatusCode.UNAVAILABLE,
                                 "the frontend serving this stream is stopping (a restart or "
                                 "shutdown); every request it read is answered: open a new "
                                 "stream for the rest")
        finally:
            stopping.cancel()
            if following is not None:
                # The call cancelled (the client gone) while the next read was pending: grpc
                # ends that read later, StopAsyncIteration, which asyncio logged at ERROR as
                # "Task exception was never retrieved" (an outside check).
                following.add_done_callback(lambda read: read.cancelled() or read.exception())
            for task in running:
                task.cancel()

    # --- grpc.health.v1.Health ---

    async def health_check(self, request, context):
        if request.service not in HEALTHY_SERVICES:
            raise CallFailed(grpc.StatusCode.NOT_FOUND,
                             f"unknown service {request.service!r}: this server's are "
                             f"{HEALTHY_SERVICES[1]!r} and '' (the whole server)")
        status, _ = await self._json(context, "/v2/health/ready", ok=(200, 400))
        serving = protos.HealthCheckResponse.SERVING if status == 200 else \
            protos.HealthCheckResponse.NOT_SERVING
        return protos.HealthCheckResponse(status=serving)

    def handlers(self, limit: int) -> list[grpc.GenericRpcHandler]:
        """Each method's handler, its message types and streaming read from the service's
        descriptor (frontend/protos), not written again here; a request message inflates to
        `limit` bytes at most (-1: no limit)."""
        methods = {protos.KSERVE_SERVICE: {
            "ServerLive": self.server_live, "ServerReady": self.server_ready,
            "ModelReady": self.model_ready, "ServerMetadata": self.server_metadata,
            "ModelMetadata": self.model_metadata, "ModelConfig": self.model_config,
            "ModelInfer": self.model_infer, "ModelStreamInfer": self.model_stream_infer,
            "ModelStatistics": self.model_statistics, "RepositoryIndex": self.repository_index,
            "RepositoryModelLoad": self.repository_model_load,
            "RepositoryModelUnload": self.repository_model_unload},
            protos.HEALTH_SERVICE: {"Check": self.health_check}}
        return [grpc.method_handlers_generic_handler(service, {
            name: _handler(protos.POOL.FindServiceByName(service).methods_by_name[name],
                           _ends(behavior, name), limit)
            for name, behavior in behaviors.items()}) for service, behaviors in methods.items()]


def _handler(method, behavior: Callable[..., Awaitable], limit: int) -> grpc.RpcMethodHandler:
    """grpc's handler of a unary or bidirectional-stream `method` (a MethodDescriptor). A
    unary method is served as a client stream of which the first message is the request:
    grpc.aio's own unary handler never answers a call whose client half-closes without a
    message (an empty body, or a message cut short), which then held the call until nginx's
    grpc_read_timeout; here it is INVALID_ARGUMENT at once."""
    options = dict(
        request_deserializer=parser(protos.message(method.input_type.full_name), limit),
        response_serializer=protos.message(method.output_type.full_name).SerializeToString)
    if method.client_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior, **options)
    return grpc.stream_unary_rpc_method_handler(_first_request(behavior), **options)


def _first_request(behavior: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
    async def handler(requests, context):
        request = await context.read()
        if request is grpc.aio.EOF:
            request = MISSING
        return await behavior(request, context)

    return handler


class Unimplemented(grpc.GenericRpcHandler):
    """Last of the handlers: a method no service here has (Triton's statistics, repository,
    shared memory, ...) is UNIMPLEMENTED, as grpc answers it, and counted in
    shmserve_grpc_calls_total as method "other" (an outside check's 91 RepositoryIndex calls
    counted nowhere)."""

    def service(self, handler_call_details):
        method = handler_call_details.method

        async def refuse(requests, context):
            metrics.GRPC_CALLS.labels("other", grpc.StatusCode.UNIMPLEMENTED.name).inc()
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                f"this server has no method {method[:200]!r} (docs/protocols.md "
                                "lists the ones it has; reflection too)")

        return grpc.stream_stream_rpc_method_handler(refuse)


class _StreamCall:
    """A stream's context for one of its requests: the stream's metadata and deadline; initial
    metadata is the stream's, sent once (not per response). Its request id is the stream's
    (nginx's, one access line for the whole stream) and `:N`, the request's place in the
    stream: every request of a stream had the stream's id on its access and batch lines, so
    the lines of one could not be told from another's (an outside check: 5 access lines, one
    id); `grep STREAM_ID` still finds them all."""

    def __init__(self, context: grpc.aio.ServicerContext, number: int = 0) -> None:
        self._context = context
        self._number = number

    def invocation_metadata(self):
        metadata = self._context.invocation_metadata() or ()
        if not self._number:
            return metadata
        return tuple((key, f"{value}:{self._number}"
                      if key == "x-request-id" and isinstance(value, str)
                      and len(value) + 1 + len(str(self._number)) <= REQUEST_ID_MAX else value)
                     for key, value in metadata)

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()

    async def send_initial_metadata(self, metadata) -> None:
        pass


def _ends(method: Callable[..., Awaitable], name: str) -> Callable[..., Awaitable]:
    """`method` (the gRPC method `name`) with its CallFailed as the call's status, and any
    other error as INTERNAL with a line in the log: a call always ends with a status, never a
    hung stream. Each call counts in shmserve_grpc_calls_total by its status."""
    async def handler(request, context):
        code = grpc.StatusCode.INTERNAL
        try:
            if isinstance(request, Undecodable):
                raise CallFailed(request.code, request.message)
            reply = await method(request, context)
            code = grpc.StatusCode.OK
            return reply
        except CallFailed as exc:
            code = exc.code
            if exc.metadata:
                context.set_trailing_metadata(exc.metadata)
            await context.abort(exc.code, exc.message)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("frontend.grpc_error", extra={"fields": {"method": name}})
            await context.abort(grpc.StatusCode.INTERNAL, "internal error (logged by the frontend)")
        finally:
            metrics.GRPC_CALLS.labels(name, code.name).inc()

    return handler
