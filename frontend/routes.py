"""HTTP routes: decode, validate, tokenize, dispatch, render."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time

import numpy as np
from aiohttp import web

import shmserve
from frontend import codec, metrics, schemas, vectors
from frontend.app import (CONFIG, DISPATCHER, INDEX, INFLIGHT, LOG_FIELDS, MODEL_NAME, MODELS, POOL,
                          REPLIED_AT, REQUEST_ID, STAGES, TOKENIZE_MS, ServedModel)
from frontend.dispatch import Outcome
from frontend.errors import ApiError
from frontend.tokenizer import Encoded
from shmserve.metrics import observe_many

# Tokenize off the event loop when a request is this large (characters); small ones are faster
# inline than a thread hop.
_THREAD_TOKENIZE_CHARS = 4096


def add_routes(app: web.Application) -> None:
    from frontend import admin

    admin.add_routes(app)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/predict", predict)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics_route)


async def embeddings(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    body = await codec.read_body(request)
    parsed = schemas.parse_openai_embeddings(body, cfg.limits)
    model, outcome, enc = await _embed(request, parsed, "input")
    as_msgpack = codec.wants_msgpack(request)
    if parsed.encoding_format == "base64":
        rows = [base64.b64encode(np.ascontiguousarray(r, "<f4").tobytes()).decode("ascii")
                for r in outcome.vectors]
    else:
        rows = codec.vectors(outcome.vectors, as_msgpack)
    data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)]
    return codec.render(request, {
        "object": "list", "data": data, "model": model.spec.name,
        "usage": {"prompt_tokens": enc.tokens, "total_tokens": enc.tokens},
    }, headers=_stage_headers(request, outcome))


async def predict(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    body = await codec.read_body(request)
    parsed = schemas.parse_predict(body, cfg.limits)
    model, outcome, enc = await _embed(request, parsed, "texts")
    return codec.render(request, {
        "results": codec.vectors(outcome.vectors, codec.wants_msgpack(request)),
        "model": model.spec.name,
        "revision": outcome.revision,
        "usage": {"prompt_tokens": enc.tokens, "total_tokens": enc.tokens},
    }, headers=_stage_headers(request, outcome))


async def _embed(request: web.Request, parsed: schemas.EmbedRequest,
                 param: str) -> tuple[ServedModel, Outcome, Encoded]:
    cfg = request.app[CONFIG]
    model = request.app[MODELS].resolve(parsed.model)
    request[MODEL_NAME] = model.spec.name
    vectors.check_dimensions(parsed.dimensions, model.spec.dim)
    deadline = time.time() + _timeout(request, cfg.frontends.request_timeout_s)
    inflight = request.app[INFLIGHT]
    if inflight[0] >= cfg.frontends.max_inflight:
        raise ApiError("overloaded", f"{inflight[0]} requests in flight on this frontend "
                       "(frontends.max_inflight)", retry_after=1)
    inflight[0] += 1
    gauge = metrics.INFLIGHT.labels(str(request.app[INDEX]))
    gauge.inc()
    try:
        started = time.perf_counter()
        if parsed.token_ids is not None:  # tokenized by the client
            enc = model.encoder.from_ids(parsed.token_ids, param)
        elif sum(map(len, parsed.texts)) > _THREAD_TOKENIZE_CHARS:
            enc = await asyncio.get_running_loop().run_in_executor(
                None, model.encoder.encode, parsed.texts, param, parsed.truncate,
                parsed.truncation_direction)
        else:
            enc = model.encoder.encode(parsed.texts, param, parsed.truncate,
                                       parsed.truncation_direction)
        request[TOKENIZE_MS] = (time.perf_counter() - started) * 1000
        request[LOG_FIELDS].update(texts=enc.count, tokens=enc.tokens,
                                   tokenize_ms=round(request[TOKENIZE_MS], 3))
        if cfg.logging.log_inputs and parsed.texts is not None:
            request[LOG_FIELDS]["inputs"] = parsed.texts
        outcome = await request.app[DISPATCHER].run(
            model.spec.name, model.spec.dim, enc, request[REQUEST_ID], deadline,
            _priority(request, parsed, cfg.frontends.default_priority))
    finally:
        inflight[0] -= 1
        gauge.dec()
    metrics.TEXTS.labels(model.spec.name).inc(enc.count)
    metrics.TOKENS.labels(model.spec.name).inc(enc.tokens)
    if enc.truncated:
        metrics.TRUNCATED.labels(model.spec.name).inc(enc.truncated)
    observe_many(metrics.INPUT_TOKENS.labels(model.spec.name), np.diff(enc.offsets))
    # The middleware adds the transfer and total stages once the response is rendered.
    request[STAGES] = {"tokenize": request[TOKENIZE_MS] / 1000,
                       "queue": outcome.result.queue_ms / 1000,
                       "inference": outcome.result.inference_ms / 1000}
    request[REPLIED_AT] = outcome.received_at
    request[LOG_FIELDS].update(batch_size=outcome.result.batch_size, worker=outcome.worker,
                               queue_ms=round(outcome.result.queue_ms, 3),
                               inference_ms=round(outcome.result.inference_ms, 3))
    if parsed.dimensions is not None:
        outcome = dataclasses.replace(outcome, vectors=vectors.shorten(
            outcome.vectors, parsed.dimensions, model.spec.normalize))
    return model, outcome, enc


def _priority(request: web.Request, parsed: schemas.EmbedRequest, default: int) -> int:
    """The body's `priority` field, else the X-Priority header, else the configured default."""
    if parsed.priority is not None:
        return parsed.priority
    header = request.headers.get("X-Priority")
    return default if header is None else schemas.parse_priority(header, "X-Priority")


def _timeout(request: web.Request, default: float) -> float:
    raw = request.headers.get("X-Request-Timeout")
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 3600:
        raise ApiError("invalid_request", "X-Request-Timeout must be seconds in (0, 3600]",
                       param="X-Request-Timeout")
    return value


def _stage_headers(request: web.Request, outcome: Outcome) -> dict[str, str]:
    return {
        "X-Model-Revision": outcome.revision,
        "X-Batch-Size": str(outcome.result.batch_size),
        "X-Tokenization-Time": f"{request[TOKENIZE_MS]:.3f}",
        "X-Queue-Time": f"{outcome.result.queue_ms:.3f}",
        "X-Inference-Time": f"{outcome.result.inference_ms:.3f}",
    }


async def list_models(request: web.Request) -> web.Response:
    models = request.app[MODELS]
    return codec.render(request, {"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "shmserve"}
        for name in models.by_name]})


async def health(request: web.Request) -> web.Response:
    return codec.render(request, {"status": "ok", "version": shmserve.__version__})


async def ready(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    workers = [{"worker": link.index, "alive": link.alive, "ready": link.ready,
                "device": link.beat.device if link.beat else None,
                "queued_texts": link.beat.queued_texts if link.beat else None}
               for link in pool.links]
    if pool.all_ready:
        return codec.render(request, {"status": "ready", "workers": workers})
    return codec.render(request, {"status": "loading", "workers": workers}, status=503)


async def metrics_route(request: web.Request) -> web.Response:
    body, content_type = await asyncio.get_running_loop().run_in_executor(
        None, metrics.exposition, request.app[CONFIG])
    return web.Response(body=body, headers={"Content-Type": content_type})
