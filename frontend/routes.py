"""HTTP routes: decode, validate, tokenize, dispatch, render."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import os
import time
from typing import Any

import numpy as np
from aiohttp import web

import shmserve
from frontend import codec, metrics, schemas, scores, tasks, vectors
from frontend.app import CONFIG, MODELS, POOL, Models, ServedModel
from frontend.dispatch import Outcome
from frontend.errors import ApiError
from frontend.pool import WorkerPool
from frontend.tokenizer import Encoded
from shmserve import topology
from shmserve.protocol import PROTOCOL_VERSION


def add_routes(app: web.Application) -> None:
    from frontend import admin

    admin.add_routes(app)
    scores.add_routes(app)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)  # ids may hold '/' (aliases)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics_route)


async def embeddings(request: web.Request) -> web.Response:
    return await openai_embeddings(request, await codec.read_body(request))


async def openai_embeddings(request: web.Request, body: Any) -> web.Response:
    """OpenAI's embeddings answer to `body`, as read (infinity's /embeddings adapts it first:
    frontend.infinity)."""
    parsed = schemas.parse_openai_embeddings(body, request.app[CONFIG].limits)
    model, outcome, enc = await embed(request, parsed, "input", ids_hint=OPENAI_IDS_HINT)
    as_msgpack = codec.wants_msgpack(request)
    if parsed.encoding_format == "base64":
        rows = [base64.b64encode(np.ascontiguousarray(r, "<f4").tobytes()).decode("ascii")
                for r in outcome.vectors]
    else:
        rows = codec.vectors(outcome.vectors, as_msgpack)
    data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)]
    return codec.render(request, {
        "object": "list", "data": data, "model": model.spec.name, "revision": outcome.revision,
        "usage": {"prompt_tokens": enc.tokens, "total_tokens": enc.tokens},
    }, headers=tasks.stage_headers(request, outcome))


def default_predict_model(models: Models) -> ServedModel:
    """/predict without `model`: the first embedding model, as on /v1/embeddings (the first
    configured model was taken whatever its task: with a classifier listed first, an
    embedding client got labels, or shmserve.client's embed() a 422, an outside check);
    with none served, the first classification model; else the first model (its task's
    refusal follows)."""
    for task in ("embedding", "classification"):
        served = next((m for m in models.by_name.values() if tasks.serves(m, task)), None)
        if served is not None:
            return served
    return models.resolve(None)


async def predict(request: web.Request, body: Any) -> web.Response:
    """The native /predict (`texts`): embeddings, or a classification model's labels
    (frontend.scores). The route is frontend.tei's, which also takes TEI's body (`inputs`)."""
    cfg = request.app[CONFIG]
    parsed = schemas.parse_predict(body, cfg.limits)
    spec = default_predict_model(request.app[MODELS]).spec if parsed.model is None \
        else request.app[MODELS].resolve(parsed.model).spec
    if spec.task == "classification":
        if parsed.prompt_name is not None:
            raise ApiError("invalid_request", "'prompt_name' applies to embedding models; "
                           f"{spec.name!r} is a classification model", param="prompt_name")
        return await scores.predict(request, body, parsed)
    if spec.task == "rerank":
        raise ApiError("invalid_request", f"model {spec.name!r} is a rerank model; /predict "
                       "serves embedding and classification models (rerank: POST /v1/rerank "
                       "or /rerank)", param="model", code="unsupported_task")
    if body.get("top_k") is not None:  # refused, not ignored (an outside check)
        raise ApiError("invalid_request", "'top_k' applies to classification models; "
                       f"{spec.name!r} is {spec.task!r}", param="top_k")
    model, outcome, enc = await embed(request, parsed, "texts")
    return codec.render(request, {
        "results": codec.vectors(outcome.vectors, codec.wants_msgpack(request)),
        "model": model.spec.name,
        "revision": outcome.revision,
        "usage": {"prompt_tokens": enc.tokens, "total_tokens": enc.tokens},
    }, headers=tasks.stage_headers(request, outcome))


# langchain-openai's OpenAIEmbeddings, unless told check_embedding_ctx_length=False, tokenizes
# with tiktoken and sends OpenAI's ids; a user saw only the id refused (an outside check).
OPENAI_IDS_HINT = ("; ids from OpenAI's tiktoken do not fit it (langchain-openai sends those "
                   "unless given check_embedding_ctx_length=False): send texts, or ids from "
                   "POST /tokenize")


async def embed(request: web.Request, parsed: schemas.EmbedRequest, param: str,
                model: ServedModel | None = None, per_token: bool = False, ids_hint: str = "",
                raw: bool = False) -> tuple[ServedModel, Outcome, Encoded]:
    """The embedding pipeline every embedding route shares (native, OpenAI, TEI, KServe).
    `model`: what tasks.resolve already gave the caller for `parsed.model`. `per_token`: the
    last hidden state of every token (TEI's /embed_all), rows [tokens, dim] by the encoded
    offsets. `raw`: a model that normalises its vectors gives them unnormalised (TEI's
    normalize=false; Submit.raw)."""
    if model is None:
        model = tasks.resolve(request, parsed.model, "embedding")
    vectors.check_dimensions(parsed.dimensions, model.spec.dim)
    if parsed.token_ids is not None:  # tokenized by the client
        # (the ids' count as the characters: a large request's range check and copy run off
        # the event loop, as a long text's tokenizing does)
        ran = await tasks.run(
            request, model, lambda enc: enc.from_ids(parsed.token_ids, param, parsed.truncate,
                                                     parsed.truncation_direction, ids_hint),
            sum(map(len, parsed.token_ids)), texts=len(parsed.token_ids),
            priority=parsed.priority, user=parsed.user,
            per_token=per_token, raw=raw)
    else:
        ran = await tasks.run(
            request, model, lambda enc: enc.encode(parsed.texts, param, parsed.truncate,
                                                   parsed.truncation_direction,
                                                   parsed.prompt_name),
            sum(map(len, parsed.texts)), texts=len(parsed.texts),
            priority=parsed.priority, user=parsed.user,
            inputs=parsed.texts, per_token=per_token, raw=raw)
    outcome = ran.outcome
    if parsed.dimensions is not None:
        outcome = dataclasses.replace(outcome, vectors=vectors.shorten(
            outcome.vectors, parsed.dimensions, model.spec.normalize and not raw))
    return model, outcome, ran.enc


async def list_models(request: web.Request) -> web.Response:
    models = request.app[MODELS]
    return codec.render(request, {"object": "list", "data": [
        model_object(model) for model in models.by_name.values()]})


async def get_model(request: web.Request) -> web.Response:
    """OpenAI's model retrieval (`client.models.retrieve`): a served name or alias, else 404."""
    return codec.render(request, model_object(
        request.app[MODELS].resolve(request.match_info["model"])))


def model_object(model: ServedModel) -> dict:
    return {"id": model.spec.name, "object": "model", "created": _created(model.spec.directory),
            "owned_by": "shmserve"}


def _created(directory) -> int:
    """OpenAI's `created`: when the weights were written (the same on every frontend, where a
    start time would differ); 0 for a model without a weights file (null)."""
    try:
        return int(os.stat(directory / "model.safetensors").st_mtime)
    except (OSError, TypeError):
        return 0


async def health(request: web.Request) -> web.Response:
    # protocol: the worker protocol it speaks (shmserve.versions asks it before a restart)
    return codec.render(request, {"status": "ok", "version": shmserve.__version__,
                                  "protocol": PROTOCOL_VERSION})


async def ready(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    await pool.first_heard()  # a new frontend: not "loading" before it has heard anyone
    now = time.monotonic()
    configured = topology.worker_devices(request.app[CONFIG])
    workers = [{"worker": link.index, "alive": link.alive, "ready": link.ready,
                "pid": link.beat.pid if link.beat else None,
                "device": link.beat.device if link.beat else None,
                # what the config asks for (device: what the worker reports once loaded; a
                # failing worker's read "loading", an outside check)
                "configured_device": topology.device_label(configured[link.index])
                if link.index < len(configured) else None,
                "queued_texts": link.beat.queued_texts if link.beat else None,
                # the forward pass running now, seconds; stalled: past workers.stalled_pass_s
                "pass_s": round(link.beat.pass_s, 3) if link.beat else None,
                "stalled": bool(link.beat and pool.watchdog.stalled(link.beat)),
                # since its last heartbeat (workers.hung_kill_s of silence: killed)
                "silent_s": round(now - link.last_beat, 1) if link.beat else None,
                # the worker protocol its heartbeats name; another than this frontend's
                # (an upgrade half taken, README: Upgrading) is not used
                "protocol": link.protocol,
                # its loads failed in a row since it was last ready, and the last one's error
                # (it exits after each, and supervisord starts it again)
                "failed_loads": link.failed_loads, "load_error": link.load_error,
                # the process that failed last (a command that started it stops waiting)
                "failed_pid": link.failed_pid,
                # its models that did not load while others did: it serves those, not these,
                # and tries each again in retry_in_s
                "unloaded": [{"model": u.model, "error": u.error, "failures": u.failures,
                              "retry_in_s": u.retry_in_s} for u in link.unloaded],
                # models it serves apart from the run state (/admin/models: diverged)
                "diverged": diverged(link)}
               for link in pool.links]
    status = readiness(pool, request.app[MODELS])
    # Retry-After on the 503, as every 503 of this server carries it (an outside check)
    return codec.render(request, {"status": status, "workers": workers},
                        status=200 if status in SERVING else 503,
                        headers=None if status in SERVING else {"Retry-After": "1"})


SERVING = ("ready", "degraded")  # readiness() statuses under which every model is served


def diverged(link) -> list[str]:
    """The models worker `link` serves apart from the run state, as its heartbeats say."""
    return [i.name for i in link.beat.models if i.state == "diverged"] if link.beat else []


def readiness(pool: WorkerPool, models: Models) -> str:
    """GET /ready's status. ready: every worker is, with every model it hosts. loading: not
    every configured worker has been ready once since the deployment started. degraded (200):
    some worker is lost or restarting, but every served model (an A/B split: one of its arms)
    has a ready worker, so requests succeed; a rolling restart does not take the pod out of a
    readiness probe. unavailable (503): some model has no ready worker. failing (503): as
    loading or unavailable, where a worker not ready has failed to load its models, or a ready
    one some of them (the worker entries name the error). Also degraded: every worker ready,
    but one serves a model apart from the run state (`diverged`: its reloaded source gone or
    damaged since; docs/models.md), or without one it could not load that another serves."""
    unloaded = any(link.unloaded for link in pool.links)
    if pool.all_ready and not unloaded:
        return "degraded" if any(diverged(link) for link in pool.links) else "ready"
    failing = unloaded or any(link.load_error and not link.ready for link in pool.links)
    if not pool.started:
        return "failing" if failing else "loading"
    # (a split's arm without one gives its share to the others: frontend.variants)
    if all(any(pool.ready_links(v.unit) for v in model.variants)
           for model in models.by_name.values()):
        return "degraded"
    return "failing" if failing else "unavailable"


# A scrape's exposition (and Triton's statistics, read from the same files) runs on a thread of
# its own: in the default executor it queued behind every tokenization in flight, and under a
# flood of large requests scrapes took past nginx's timeout (504; an outside check).
EXPOSITION = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="exposition")


async def read_metrics(read, *args):
    """`read(*args)` over the metrics files, on EXPOSITION's thread, after this turn's updates
    are written (so a read right after a request counts it); 503 where the files cannot be read
    (this frontend out of file descriptors, ...: nothing half read)."""
    metrics.turn.flush()
    try:
        return await asyncio.get_running_loop().run_in_executor(EXPOSITION, read, *args)
    except OSError as exc:
        raise ApiError("unavailable", f"this frontend cannot read the metrics files: {exc}",
                       retry_after=1) from None


async def metrics_route(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    body, content_type = await read_metrics(metrics.exposition, request.app[CONFIG],
                                            len(pool.links),
                                            [link.index for link in pool.links if link.hung])
    return web.Response(body=body, headers={"Content-Type": content_type})
