"""The aiohttp application: resources under typed keys, one middleware for ids, timing, errors,
metrics and the access log line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import AsyncIterator

from aiohttp import web

from frontend import codec, metrics, own_files
from frontend.auth import ApiKeys, authenticate
from frontend.dispatch import Dispatcher
from frontend.errors import ApiError, kserve_shaped, status_on
from frontend.heap import HeapTrim
from frontend.httpparser import nginx_size
from frontend.pool import WorkerPool
from frontend.respcache import ResponseCache
from frontend.tokenizer import TextEncoder
from frontend.variants import Splits, Variant
from frontend.variants import revision as variant_revision
from shmserve import arena as shm
from shmserve import topology
from shmserve.config import Config
from shmserve.models import ModelSpec, inspect, units
from shmserve.state import Watch

log = logging.getLogger("shmserve.frontend")
access = logging.getLogger("shmserve.access")

CLIENT_CLOSED = 499  # nginx's status for a request whose client closed the connection
REQUEST_ID_MAX = 128  # a longer X-Request-ID is replaced by a made-up one
_REQUEST_ID = re.compile(rf"^[A-Za-z0-9._:\-]{{1,{REQUEST_ID_MAX}}}$")


@dataclass(frozen=True, slots=True)
class ServedModel:
    spec: ModelSpec  # its first variant's, under the model's name
    encoder: TextEncoder  # its first variant's
    variants: tuple[Variant, ...]  # one, unit named as the model, without an A/B split
    sticky_key: str = ""


class Models:
    """Configured models by name and alias; the first one is the default."""

    def __init__(self, cfg: Config) -> None:
        self.by_name: dict[str, ServedModel] = {}
        self._names: dict[str, str] = {}
        for model_cfg in cfg.models:
            variants = []
            for unit in units(model_cfg):
                # Workers report the revision; the roots confine where models may come from.
                spec = inspect(unit.config, with_revision=False, roots=cfg.model_root_paths)
                variants.append(Variant(unit.variant, unit.name, spec,
                                        TextEncoder(spec, cfg.limits.truncate), unit.weight))
            first = variants[0]
            spec = dataclasses.replace(first.spec, name=model_cfg.name)
            self.by_name[spec.name] = ServedModel(spec, first.encoder, tuple(variants),
                                                  model_cfg.sticky_key)
            for name in (model_cfg.name, *model_cfg.aliases):
                self._names[name] = spec.name
        self.default = cfg.models[0].name

    def canonical(self, name: str) -> str | None:
        """A served model's name for one of its names or aliases; None for any other."""
        return self._names.get(name)

    def resolve(self, name: str | None) -> ServedModel:
        if name is None:
            return self.by_name[self.default]
        canonical = self._names.get(name)
        if canonical is None:
            shown = repr(name) if len(name) <= 200 else f"{name[:200]!r}... ({len(name)} chars)"
            raise ApiError("not_found", f"model {shown} is not served; see GET /v1/models",
                           param="model", code="model_not_found")
        return self.by_name[canonical]


CONFIG = web.AppKey("config", Config)
INDEX = web.AppKey("index", int)
MODELS = web.AppKey("models", Models)
POOL = web.AppKey("pool", WorkerPool)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
CACHE = web.AppKey("cache", object)  # a frontend.respcache.ResponseCache, or None (none)
INFLIGHT = web.AppKey("inflight", list)  # [count]: a mutable cell
HEAP = web.AppKey("heap", HeapTrim)  # the heap a large request grew, given back when idle
UNBUFFERED = web.AppKey("unbuffered", object)  # an Unbuffered: answers held for slow readers
SPLITS = web.AppKey("splits", Splits)
API_KEYS = web.AppKey("api_keys", ApiKeys)  # no key: the inference routes are open
TRACING = web.AppKey("tracing", object)  # a frontend.tracing.Tracing, or None
DRAIN_END = web.AppKey("drain_end", list)  # [the task of `_drain`], once stopping
# Probes and scrapes: no access line, no trace.
PROBES = frozenset({"/health", "/ready", "/metrics"})
# KServe's per-model readiness: a probe too. Behind a key, tritonclient's is_model_ready()
# said False (its 401 hidden) while is_server_ready() said True (an outside check).
MODEL_READY = frozenset({"/v2/models/{model}/ready", "/v2/models/{model}/versions/{version}/ready"})
KSERVE_PROBES = MODEL_READY | {"/v2/health/live", "/v2/health/ready"}
# Open whatever auth.api_keys says: probes, scrapes, the API's description, and /admin/*,
# which has a token of its own.
OPEN_PATHS = PROBES | KSERVE_PROBES | {"/openapi.json"}
QUIET_PATHS = PROBES | KSERVE_PROBES  # no access line, no trace

# Per-request storage, typed (aiohttp warns on plain string keys).
REQUEST_ID = web.RequestKey("request_id", str)
# time.time() when this frontend began the request (its body not yet read): deadlines count
# from it (frontend.tasks.run)
ARRIVED = web.RequestKey("arrived", float)
LOG_FIELDS = web.RequestKey("log", dict)  # extra fields for the access log line
MODEL_NAME = web.RequestKey("model", str)
TOKENIZE_MS = web.RequestKey("tokenize_ms", float)
TOKENIZE_AT = web.RequestKey("tokenize_at", float)  # perf_counter when tokenizing began
CHARS = web.RequestKey("chars", int)  # characters of the inputs it ran (X-Compute-Characters)
STAGES = web.RequestKey("stages", dict)  # seconds per stage, set by the embedding pipeline
REPLIED_AT = web.RequestKey("replied_at", float)  # when the worker's reply arrived
REVISION = web.RequestKey("revision", str)  # of the weights that served the request
VARIANT = web.RequestKey("variant", str)  # the A/B variant that served it ("" without a split)
# An inference request's A/B variant ("" without a split) and priority, once chosen: its
# metrics by arm and priority (metrics.observe_inference)
CHOSEN = web.RequestKey("chosen", tuple)
ARM = web.RequestKey("arm", Variant)  # the frontend.variants.Variant chosen (Triton's statistics)
INPUTS = web.RequestKey("inputs", int)  # inputs the request ran through a model
# The response cache's part in a request (frontends.response_cache_mb): hit or miss, the
# seconds it took (looking up; and, a miss, keeping the rows), its keys and revision
CACHED = web.RequestKey("cached", tuple)
TIMEOUT_S = web.RequestKey("timeout_s", float)  # a protocol's own deadline (KServe's
                                                 # parameters.timeout), with X-Request-Timeout's
PINNED = web.RequestKey("pinned", object)  # a frontend.variants.Variant the request names (a
                                           # KServe version), instead of the split's choice


@web.middleware
async def observe(request: web.Request, handler) -> web.StreamResponse:
    started = time.perf_counter()
    request[ARRIVED] = time.time()
    sent = request.headers.get("X-Request-ID", "")
    request[REQUEST_ID] = sent if _REQUEST_ID.match(sent) else uuid.uuid4().hex
    request[LOG_FIELDS] = {}
    try:
        keys = request.app[API_KEYS].current()
        if keys and not _open(request):
            authenticate(request, keys)
        response = await handler(request)
    except ApiError as exc:
        response = error_response(request, exc)
        if exc.attempts > 1:  # sent again to a worker, and failed all the same
            request[LOG_FIELDS]["attempts"] = exc.attempts
        if exc.worker is not None:  # the worker that failed it
            request[LOG_FIELDS]["worker"] = exc.worker
    except web.HTTPException as exc:  # routing: unknown path, wrong method
        kind = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(
            exc.status, "bad_request")
        allow = exc.headers.get("Allow")
        message = (f"{request.method} is not allowed on {request.path}; it takes {allow}"
                   if allow else no_route(request) if exc.status == 404
                   else exc.reason or "error")
        response = error_response(request, ApiError(kind, message))
        if allow:  # RFC 9110: a 405 names the methods the resource takes
            response.headers["Allow"] = allow
    except asyncio.CancelledError:
        # The client went away (the handler was cancelled): nothing to answer, but the request
        # still gets its access line and metrics, as nginx's 499 "client closed request".
        ended = time.perf_counter()
        request[LOG_FIELDS]["error"] = "client_closed"
        _record(request, web.Response(status=CLIENT_CLOSED), ended - started, ended)
        raise
    except Exception:  # the global handler: never a traceback to the client
        log.exception("unhandled error", extra={"fields": {"request_id": request[REQUEST_ID]}})
        response = error_response(request, ApiError("internal_error", "internal error"))
    ended = time.perf_counter()
    elapsed = ended - started
    response.headers["X-Request-ID"] = request[REQUEST_ID]
    response.headers["X-Process-Time"] = f"{elapsed * 1000:.2f}"
    body = getattr(response, "body", None)
    if isinstance(body, bytes) and len(body) > UNBUFFERED_BYTES \
            and request.app[UNBUFFERED].take(response, len(body)):
        response.headers["X-Accel-Buffering"] = "no"
    _record(request, response, elapsed, ended)
    return response


def no_route(request: web.Request) -> str:
    """A 404's message: the path, the route it likely meant (a base URL with or without /v1:
    the openai client given one without it, or a TEI client given one with it, got a bare
    "Not Found"; or with a slash doubled by a base URL's trailing one), and where the routes
    are listed."""
    path = request.rel_url.raw_path  # as sent: "/v1%2Fembeddings" is not /v1/embeddings
    known = {resource.canonical for resource in request.app.router.resources()}
    merged = re.sub("/{2,}", "/", path)  # a base URL ending in "/" ("//v1/embeddings")
    guesses = ("/v1" + path, path[3:] if path.startswith("/v1/") else "", path.rstrip("/"),
               merged, merged.rstrip("/"), "/v1" + merged)
    guess = next((g for g in guesses if g and g != path and g in known), None)
    shown = path if len(path) <= 200 else path[:200] + "..."
    return (f"no route {shown}" + (f"; did you mean {guess}?" if guess else "")
            + " (GET /openapi.json lists the routes)")


# Answers larger than this pass through nginx unbuffered (X-Accel-Buffering: no, which nginx
# reads and drops). On a graceful stop an nginx worker exits once no request has a timer left,
# and one sending a fully buffered answer to a client that keeps up has none: a 70 MB /embed_all
# answer in transfer was cut at `shmserve down` 3 times in 3 (an outside check). Unbuffered,
# the request keeps its upstream's and client's timers to the last byte. Small answers stay
# buffered: unbuffered for all cost the null pipeline ~4% (scripts/ab.py, 2 runs of 4 and 6
# rounds, medians 0.953 and 0.962), and an answer within a socket's buffer is written at once.
UNBUFFERED_BYTES = 256 * 1024


class Unbuffered:
    """The bytes of unbuffered answers this frontend holds, at most UNBUFFERED_BUDGET: a client
    that reads slowly keeps an unbuffered answer in the frontend until its last byte (120
    clients reading 4 MB answers at 64 bytes every 2 s took a frontend to 730 MB, rising; an
    outside check). Past the budget, answers go buffered: nginx takes them at once (into its
    temp files) and the frontend lets them go. Held until the response object is freed, which
    aiohttp does once its body was written to the socket."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.held = 0

    def take(self, response: web.StreamResponse, size: int) -> bool:
        if self.held + size > self.budget:
            return False
        self.held += size
        weakref.finalize(response, self._release, size)
        return True

    def _release(self, size: int) -> None:
        self.held -= size


UNBUFFERED_BUDGET = 128 * 2**20


def _open(request: web.Request) -> bool:
    """Whether the route this request matched (not its raw path: `/health/../x` matches no
    route) needs no API key."""
    if isinstance(request.match_info.http_exception, web.HTTPMethodNotAllowed):
        return True  # the path exists and the method is wrong: 405 (with Allow), whoever asks
    resource = request.match_info.route.resource
    path = resource.canonical if resource is not None else ""
    return path in OPEN_PATHS or path.startswith("/admin/")


def error_response(request: web.Request, exc: ApiError) -> web.Response:
    fields = request[LOG_FIELDS]
    fields["error"] = exc.kind
    # why, for whoever follows one request id: the refusal's reason (as
    # shmserve_frontend_refused_total's, or the worker's error code), the field at fault, the
    # finer code (an outside check: every 429 read `error=overloaded` whatever refused it)
    for key, value in (("reason", exc.reason), ("param", exc.param), ("code", exc.code)):
        if value:
            fields[f"error_{key}"] = value
    if exc.status >= 500 and request[REQUEST_ID] not in exc.message:
        exc = exc.told(f"{exc.message} (request id {request[REQUEST_ID]})")
    body = exc.kserve_body() if kserve_shaped(request.path) else exc.body()
    return codec.render(request, body, status=status_on(request.path, exc),
                        headers=exc.headers())


def _stats(request: web.Request, model: str, status: int, elapsed: float,
           stages: dict | None) -> None:
    """Triton's statistics (frontend.stats) of an inference request: a success that ran (its
    `stages`), or a failure as observe_inference counts one (a refusal of the request itself
    is neither). Its version is the revision that answered, else the one its arm serves."""
    failed = metrics.failed(status)
    if not failed and (status >= 400 or stages is None):
        return
    revision = request.get(REVISION) or variant_revision(request[ARM], request.app[POOL])
    cached = request.get(CACHED)
    metrics.stats.add(model, revision, elapsed, None if failed else stages,
                      request.get(INPUTS, 0), int(time.time() * 1000),
                      cached[:2] if cached is not None else None)


def _resource_of(request: web.Request) -> str:
    """The route a request matched no method of (its 405) is named by its path's resource (it
    was counted as "unmatched", with the unknown paths: an outside check); a path no route has
    stays "unmatched", so a label never names a made-up path."""
    if isinstance(getattr(request.match_info, "http_exception", None),
                  web.HTTPMethodNotAllowed):
        for resource in request.app.router.resources():
            info = resource.get_info()
            if info.get("path") == request.path or (
                    "pattern" in info and info["pattern"].fullmatch(request.path)):
                return resource.canonical
    return "unmatched"


def _record(request: web.Request, response: web.StreamResponse, elapsed: float,
            ended: float) -> None:
    route = request.match_info.route.resource
    path = route.canonical if route is not None else _resource_of(request)
    # a request refused before its model was resolved: the served model its body names, if any
    # (never a name no model has: a label per made-up name would grow without bound)
    model = request.get(MODEL_NAME) or request.app[MODELS].canonical(
        request.get(codec.NAMED_MODEL, "")) or ""
    metrics.observe_request(path, model, response.status, elapsed, request.get(REVISION, ""))
    if (chosen := request.get(CHOSEN)) is not None:
        metrics.observe_inference(model, *chosen, response.status, elapsed)
    stages = request.get(STAGES)  # set by a route that ran the embedding pipeline
    if stages is not None and response.status < 400:
        # The last stage ends here, once the response is rendered: reply arrival to now.
        stages["transfer"] = max(0.0, ended - request[REPLIED_AT])
        stages["total"] = elapsed
        response.headers["X-Total-Time"] = f"{elapsed * 1000:.3f}"
        response.headers["X-Compute-Time"] = str(int(elapsed * 1000))  # TEI's: whole ms
        for stage, seconds in stages.items():
            metrics.stage(stage, model).observe(seconds)
        request[LOG_FIELDS]["transfer_ms"] = round(stages["transfer"] * 1000, 3)
    if chosen is not None:
        _stats(request, model, response.status, elapsed, stages)
    if path in QUIET_PATHS:
        return  # probes and scrapes would drown the access log (and the traces)
    tracing = request.app[TRACING]
    if tracing is not None:
        try:
            trace_id = tracing.record(
                request.headers, f"{request.method} {path}", ended - elapsed, ended,
                {"http.request.method": request.method, "http.route": path,
                 "http.response.status_code": response.status,
                 "shmserve.request_id": request[REQUEST_ID], "shmserve.model": model},
                stages if response.status < 400 else None, request.get(TOKENIZE_AT),
                request.get(REPLIED_AT), error=response.status >= 500)
        except Exception:  # noqa: BLE001 - a trace is never worth a request's answer
            log.exception("tracing.failed", extra={"fields": {"request_id": request[REQUEST_ID]}})
            trace_id = None
        if trace_id is not None:
            request[LOG_FIELDS]["trace_id"] = trace_id
    # a 500 is the server's own fault; another 5xx (unavailable, a deadline) worth a look
    level = (logging.ERROR if response.status == 500 else
             logging.WARNING if response.status >= 500 else logging.INFO)
    access.log(level, "request", extra={"fields": {
        "request_id": request[REQUEST_ID], "method": request.method, "route": path,
        "model": model, "status": response.status, "total_ms": round(elapsed * 1000, 3),
        **request[LOG_FIELDS]}})


async def _resources(app: web.Application) -> AsyncIterator[None]:
    cfg, index = app[CONFIG], app[INDEX]
    prefix = f"{topology.shm_prefix(cfg)}fe{index}-"
    shm.sweep(prefix)  # a killed predecessor's arena
    arena = shm.Arena(shm.arena_name(topology.instance_id(cfg), f"fe{index}"),
                      cfg.shm.arena_mb << 20)
    pool = WorkerPool(cfg, frontend=index)
    metrics.start(app[MODELS].by_name, index, len(pool.links))
    await pool.start()
    app[POOL] = pool
    app[DISPATCHER] = Dispatcher(cfg, pool, arena)
    app[CACHE] = ResponseCache(int(cfg.frontends.response_cache_mb * (1 << 20))) \
        if cfg.frontends.response_cache_mb > 0 else None
    reporter = asyncio.create_task(
        own_files.watch(arena, index, topology.frontend_socket(cfg, index),
                        lambda: own_files.grpc_socket(app, cfg)), name="own-files")
    trimmer = asyncio.create_task(app[HEAP].watch(app[INFLIGHT]), name="heap-trim")
    log.info("frontend.started", extra={"fields": {"frontend": index, "arena": arena.name}})
    try:
        yield
    finally:
        reporter.cancel()
        trimmer.cancel()
        for task in app[DRAIN_END]:
            task.cancel()
        await pool.close()
        metrics.turn.flush()
        arena.close(unlink=True)
        if app[TRACING] is not None:
            app[TRACING].close()
        log.info("frontend.stopped", extra={"fields": {"frontend": index}})


async def _drain(app: web.Application) -> None:
    """on_shutdown (stopping, the socket no longer listening): aiohttp gives the handlers
    server.drain_timeout_s, then cancels those still running, and a cancelled handler's
    connection is cut, which nginx answered 502 (an outside check: 140 requests in a rolling
    restart of the frontends behind a backlog). Shortly before that, every request still
    waiting on a worker is answered 503 with Retry-After instead."""
    pool = app.get(POOL)
    if pool is None:
        return
    drain = app[CONFIG].server.drain_timeout_s

    async def answer() -> None:
        await asyncio.sleep(drain - min(DRAIN_MARGIN_S, drain * 0.2))
        answered = pool.stop_waiting(
            "the frontend serving this request is stopping (a restart or shutdown), and its "
            "drain (server.drain_timeout_s) ended before a worker answered; retry")
        if answered:
            log.warning("frontend.drain_ended", extra={"fields": {"answered_503": answered}})

    app[DRAIN_END].append(asyncio.create_task(answer(), name="drain-end"))


# Before the drain's end, the time the 503s take to be written (a loaded machine's seconds).
DRAIN_MARGIN_S = 2.0


def create_app(cfg: Config, index: int = 0) -> web.Application:
    from frontend import cohere, infinity, info, kserve, openapi, routes, tei

    app = web.Application(middlewares=[observe],
                          client_max_size=nginx_size(cfg.nginx.client_max_body_size))
    app[CONFIG] = cfg
    app[INDEX] = index
    app[MODELS] = Models(cfg)
    app[INFLIGHT] = [0]
    app[HEAP] = HeapTrim()
    app[UNBUFFERED] = Unbuffered(UNBUFFERED_BUDGET)
    app[DRAIN_END] = []
    app[API_KEYS] = ApiKeys(cfg, frontend=index)
    if cfg.tracing.otlp_endpoint:
        from frontend.tracing import Tracing

        app[TRACING] = Tracing(cfg, index)
    else:
        app[TRACING] = None
    app[SPLITS] = Splits(Watch(cfg))
    app.cleanup_ctx.append(_resources)
    if cfg.server.grpc_port:
        from frontend import grpc_server

        app.cleanup_ctx.append(grpc_server.serve)  # after the pool, and stopped before it
    app.on_shutdown.append(_drain)
    routes.add_routes(app)
    info.add_routes(app)
    tei.add_routes(app)
    cohere.add_routes(app)
    infinity.add_routes(app)
    kserve.add_routes(app)
    openapi.add_routes(app)
    return app
