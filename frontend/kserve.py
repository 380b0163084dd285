"""KServe v2 / Open Inference Protocol over HTTP: what Triton's and KServe's clients speak.

    GET  /v2                                    server metadata: name, version, extensions
    GET  /v2/health/live | /v2/health/ready     200 when true, 400 when not (the protocol's 4xx)
    GET  /v2/models/{m}[/versions/{v}]          model metadata: its input and output tensors
    GET  /v2/models/{m}[/versions/{v}]/ready
    GET  /v2/models/{m}[/versions/{v}]/config   Triton's model configuration (its JSON form)
    POST /v2/models/{m}[/versions/{v}]/infer    (GET: 405)
    GET  /v2/models[/{m}[/versions/{v}]]/stats  Triton's statistics (frontend.stats)
    POST /v2/repository/index                   Triton's model repository index: each model's
                                                versions and their state
    POST /v2/repository/models/{m}/load|unload  400: the config says what is served

A model name may hold '/' (aliases like "org/name" do), as Triton's client sends it unescaped.
A model's versions are its revisions, one per A/B variant (one without a split); a version in
the path pins the request to the variant serving it, and a reply's model_version is the revision
that computed it. The tensors a model takes and gives depend on its task: `TASKS` maps each
task (embedding, classification, rerank) to its `Tensors`. Body formats are in
`frontend.tensors`; a msgpack request (by Content-Type) is the same object msgpack-encoded, and a
msgpack response (by Accept) carries each output's data as its raw little-endian bytes.
Every error under /v2, from here, the middleware or nginx, is the protocol's
``{"error": "<message>"}`` (frontend.errors.ApiError.kserve_body), not the object the other
routes answer: Triton's client makes its exception's text from that string.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np
from aiohttp import web

import shmserve
from frontend import codec, routes, tasks, tensors
from frontend.app import (CONFIG, MODEL_NAME, MODELS, PINNED, POOL, REVISION, TIMEOUT_S,
                          ServedModel)
from frontend.dispatch import Outcome
from frontend.errors import ApiError
from frontend.links import did_not_load
from frontend.variants import revision
from frontend import schemas
from frontend.schemas import EmbedRequest
from frontend.stats import model_stats
from frontend.tensors import BYTES, Tensor
from shmserve import metrics as shared_metrics

EXTENSIONS = ["binary_tensor_data", "model_configuration", "model_repository", "statistics"]
HEADER_LENGTH = "Inference-Header-Content-Length"
SUBROUTES = ("ready", "config", "stats", "infer")
# Request bodies /infer reads as JSON (with Triton's binary extension): Triton's HTTP client
# sends no Content-Type, its asyncio client application/octet-stream.
JSON_TYPES = (codec.JSON, "application/octet-stream")
# Triton's model configuration names for this protocol's datatypes.
CONFIG_TYPES = {BYTES: "TYPE_STRING", "FP32": "TYPE_FP32"}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1: any size

    def metadata(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


# Runs a task's model on its decoded inputs: output arrays by name, and the dispatch outcome.
Runner = Callable[[web.Request, ServedModel, dict[str, Tensor], int | None],
                  Awaitable[tuple[dict[str, np.ndarray], Outcome]]]


@dataclass(frozen=True, slots=True)
class Tensors:
    """What one task's models take and give over this protocol, and how to run them."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    run: Runner


def _strings(request: web.Request, tensor: Tensor, name: str) -> list[str]:
    """A BYTES tensor as validated texts (UTF-8, within the request limits)."""
    texts = []
    for i, raw in enumerate(tensor.data):
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise ApiError("invalid_request", f"'{name}[{i}]' is not valid UTF-8",
                           param=name) from None
    return schemas.texts(texts, name, request.app[CONFIG].limits)


async def _run_embedding(request: web.Request, model: ServedModel, inputs: dict[str, Tensor],
                         priority: int | None) -> tuple[dict[str, np.ndarray], Outcome]:
    parsed = EmbedRequest(_strings(request, inputs["text"], "text"), model.spec.name,
                          priority=priority)
    _, outcome, _ = await routes.embed(request, parsed, "text")
    return {"embedding": outcome.vectors}, outcome


async def _run_classification(request: web.Request, model: ServedModel,
                              inputs: dict[str, Tensor], priority: int | None
                              ) -> tuple[dict[str, np.ndarray], Outcome]:
    out = await tasks.classify(request, model.spec.name,
                               _strings(request, inputs["text"], "text"), param="text",
                               priority=priority)
    return {"probabilities": out.probs}, out.ran.outcome


async def _run_rerank(request: web.Request, model: ServedModel, inputs: dict[str, Tensor],
                      priority: int | None) -> tuple[dict[str, np.ndarray], Outcome]:
    query = _strings(request, inputs["query"], "query")
    if len(query) != 1:
        raise ApiError("invalid_request", "'query' must hold exactly one text", param="query")
    out = await tasks.rerank(request, model.spec.name, query[0],
                             _strings(request, inputs["text"], "text"), param="text",
                             priority=priority)
    return {"score": out.scores, "logit": out.logits}, out.ran.outcome


def _embedding(model: ServedModel) -> Tensors:
    return Tensors(inputs=(TensorSpec("text", BYTES, (-1,)),),
                   outputs=(TensorSpec("embedding", "FP32", (-1, model.spec.dim)),),
                   run=_run_embedding)


def _classification(model: ServedModel) -> Tensors:
    return Tensors(inputs=(TensorSpec("text", BYTES, (-1,)),),
                   outputs=(TensorSpec("probabilities", "FP32",
                                       (-1, len(model.spec.labels))),),
                   run=_run_classification)


def _rerank(model: ServedModel) -> Tensors:
    return Tensors(inputs=(TensorSpec("query", BYTES, (1,)), TensorSpec("text", BYTES, (-1,))),
                   # score: the logit through the model's activation (a sigmoid is 1.0 in
                   # FP32 past ~17, so order by the logit)
                   outputs=(TensorSpec("score", "FP32", (-1,)), TensorSpec("logit", "FP32", (-1,))),
                   run=_run_rerank)


# task -> its tensors: texts -> FP32 [N, D] embeddings; texts -> FP32 [N, labels] softmax
# probabilities (labels in the model's metadata); one query + N texts -> FP32 [N] scores
# and the logits they come from.
TASKS: dict[str, Callable[[ServedModel], Tensors]] = {
    "embedding": _embedding, "null": _embedding, "classification": _classification,
    "rerank": _rerank}


def add_routes(app: web.Application) -> None:
    router = app.router
    router.add_get("/v2", server_metadata)
    router.add_get("/v2/health/live", live)
    router.add_get("/v2/health/ready", ready)
    model = "/v2/models/{model:.+?}"
    versioned = model + "/versions/{version:[^/]+}"
    # Order matters: the first pattern that fits wins, and {model} may hold '/'.
    router.add_get("/v2/models/stats", stats)
    for base in (versioned, model):
        router.add_get(base + "/ready", model_ready)
        router.add_get(base + "/config", model_config)
        router.add_get(base + "/stats", stats)
        router.add_post(base + "/infer", infer)
    router.add_post("/v2/repository/index", repository_index)
    router.add_post("/v2/repository/models/{model:.+}/load", repository_change)
    router.add_post("/v2/repository/models/{model:.+}/unload", repository_change)
    router.add_get(versioned, model_metadata)
    # Metadata of any other path, except one ending in a sub-route's word: GET .../infer is
    # that route's 405 (with Allow: POST), not the metadata of a model named "M/infer".
    router.add_get("/v2/models/{model:(?!.*/(?:" + "|".join(SUBROUTES) + ")$).+}",
                   model_metadata)


async def server_metadata(request: web.Request) -> web.Response:
    return codec.render(request, {"name": "shmserve", "version": shmserve.__version__,
                                  "extensions": EXTENSIONS})


async def live(request: web.Request) -> web.Response:
    return codec.render(request, {"live": True})


async def ready(request: web.Request) -> web.Response:
    # As GET /ready: every model served (a lost worker beside ready ones is "degraded", which
    # serves), after every configured worker was ready once.
    is_ready = routes.readiness(request.app[POOL], request.app[MODELS]) in routes.SERVING
    return codec.render(request, {"ready": is_ready}, status=200 if is_ready else 400)


async def model_ready(request: web.Request) -> web.Response:
    model = _model(request)
    _tensors(model)  # a model this protocol cannot run is not ready here: 422, as its infer
    # Ready when every arm of the model (one without an A/B split) has a ready worker; workers
    # name an arm MODEL@VARIANT.
    pool = request.app[POOL]
    is_ready = all(pool.ready_links(v.unit) for v in model.variants)
    return codec.render(request, {"name": model.spec.name, "ready": is_ready},
                        status=200 if is_ready else 400)


async def model_metadata(request: web.Request) -> web.Response:
    model = _model(request)
    spec = _tensors(model)
    body = {"name": model.spec.name, "versions": _versions(request, model),
            "platform": "shmserve", "inputs": [t.metadata() for t in spec.inputs],
            "outputs": [t.metadata() for t in spec.outputs]}
    if model.spec.task == "classification":  # what each column of "probabilities" means,
        # as a JSON string: the protocol's parameter values are strings, numbers or booleans
        body["parameters"] = {"labels": json.dumps(list(model.spec.labels))}
    return codec.render(request, body)


async def model_config(request: web.Request) -> web.Response:
    """Triton's model configuration (the JSON form of its ModelConfig protobuf), as
    tritonclient's get_model_config reads it. Models of a batching task give dims without the
    batch dimension and max_batch_size = limits.max_texts_per_request; a one-element row ([N]
    as [N, 1], the batch dimension a Triton client adds) is dims [1] reshaped to []. A rerank
    model's query is one tensor for all its texts, not batched with them: max_batch_size 0 and
    full shapes."""
    model = _model(request)
    spec = _tensors(model)
    batched = all(t.shape[0] == -1 for t in (*spec.inputs, *spec.outputs))

    def entry(t: TensorSpec) -> dict:
        dims = list(t.shape[1:] if batched else t.shape)
        out = {"name": t.name, "data_type": CONFIG_TYPES[t.datatype], "dims": dims or [1]}
        if not dims:
            out["reshape"] = {"shape": []}
        return out

    body = {"name": model.spec.name, "platform": "shmserve", "backend": "shmserve",
            "max_batch_size": request.app[CONFIG].limits.max_texts_per_request if batched
            else 0,
            "input": [entry(t) for t in spec.inputs],
            "output": [entry(t) for t in spec.outputs]}
    if model.spec.task == "classification":  # what each column of "probabilities" means
        body["parameters"] = {"labels": {"string_value": json.dumps(list(model.spec.labels))}}
    return codec.render(request, body)


async def stats(request: web.Request) -> web.Response:
    """Triton's statistics (frontend.stats) of every model, of one, or of one version."""
    models = request.app[MODELS]
    served = [_model(request)] if "model" in request.match_info else list(
        models.by_name.values())
    pinned = request.get(PINNED)
    versions = {model.spec.name: [revision(pinned, request.app[POOL])] if pinned is not None
                else _versions(request, model) for model in served}
    units = {v.unit: model.spec.name for model in models.by_name.values()
             for v in model.variants}
    samples = await routes.read_metrics(shared_metrics.hidden_samples)
    return codec.render(request, {"model_stats": model_stats(samples, versions, units)})


async def repository_index(request: web.Request) -> web.Response:
    """Triton's model repository index: every configured model's versions with their state
    (READY: a worker serves it; UNAVAILABLE: it did not load, `reason` says why; LOADING);
    `{"ready": true}` keeps the ready ones. An empty body is `{}` (tritonclient sends none)."""
    body = await codec.read_body(request) if request.body_exists else {}
    if not isinstance(body, dict):
        raise ApiError("invalid_request", "the body must be an object: {\"ready\": bool}")
    ready_only = body.get("ready", False)
    if not isinstance(ready_only, bool):
        raise ApiError("invalid_request", "'ready' must be a boolean", param="ready")
    pool = request.app[POOL]
    entries = []
    for model in request.app[MODELS].by_name.values():
        arms: dict[str, list[str]] = {}  # version -> the units serving it
        for variant in model.variants:
            arms.setdefault(revision(variant, pool), []).append(variant.unit)
        for version, units in arms.items():
            entry = {"name": model.spec.name, "version": version}
            if any(pool.ready_links(unit) for unit in units):
                entry["state"] = "READY"
            elif why := "; ".join(w for unit in units if (w := did_not_load(pool.links,
                                                                             unit)[0])):
                entry.update(state="UNAVAILABLE", reason=why)
            else:
                entry["state"] = "LOADING"
            if entry["state"] == "READY" or not ready_only:
                entries.append(entry)
    return codec.render(request, entries)


async def repository_change(request: web.Request) -> web.Response:
    """Triton's explicit load and unload: refused, as Triton refuses them outside its explicit
    mode. The config says what is served; a model's new weights are a hot reload."""
    model = request.app[MODELS].resolve(request.match_info["model"])
    raise ApiError("bad_request", f"models are served as this server's config says: change "
                   "`models` and run `shmserve apply` to add or remove one; new weights for "
                   f"{model.spec.name!r}: POST /admin/models/{model.spec.name}/reload")


async def infer(request: web.Request) -> web.Response:
    model = _model(request)
    spec = _tensors(model)
    header, tail = await _read(request)
    inputs = _inputs(spec, tensors.read_inputs(header, tail))
    wanted = tensors.requested_outputs(header, [t.name for t in spec.outputs])
    priority, timeout_s = tensors.scheduling(header)
    if timeout_s is not None:
        request[TIMEOUT_S] = timeout_s
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ApiError("invalid_request", "'id' must be a string", param="id")
    results, outcome = await spec.run(request, model, inputs, priority)
    version = request.match_info.get("version")
    if version is not None and request.get(REVISION) != version:
        # The variant switched revision between the check above and the worker's pass (a
        # reload): its rows are another version's, which the path ruled out (2 of ~380
        # requests pinned across a reload were answered by the new one, an outside check).
        raise ApiError("not_found", f"model {model.spec.name!r} has no version {version!r} "
                       f"any more: a reload replaced it with {request.get(REVISION)!r} while "
                       "this request ran", param="model_version", code="model_not_found")
    datatypes = {t.name: t.datatype for t in spec.outputs}
    outputs = [(Tensor(name, datatypes[name], results[name].shape, results[name]), binary)
               for name, binary in wanted]
    head = {"model_name": model.spec.name, "model_version": request.get(REVISION, "")}
    if request_id is not None:
        head["id"] = request_id
    headers = tasks.stage_headers(request, outcome)
    if codec.wants_msgpack(request):
        return codec.render(request, {**head, "outputs": [
            {"name": t.name, "datatype": t.datatype, "shape": list(t.shape),
             "data": list(t.data) if t.datatype == BYTES else tensors.raw_bytes(t)}
            for t, _ in outputs]}, headers=headers)
    body, header_length = tensors.encode_response(head, outputs)
    if header_length is None:
        return web.Response(body=body, content_type=codec.JSON, headers=headers)
    headers[HEADER_LENGTH] = str(header_length)
    return web.Response(body=body, content_type="application/octet-stream", headers=headers)


def _model(request: web.Request) -> ServedModel:
    """The model the path names; a version in the path pins the request to the variant (of an
    A/B split) that serves that revision."""
    model = request.app[MODELS].resolve(request.match_info["model"])
    request[MODEL_NAME] = model.spec.name
    version = request.match_info.get("version")
    if version is not None:
        pool = request.app[POOL]
        variant = next((v for v in model.variants if revision(v, pool) == version), None)
        if variant is None:
            served = ", ".join(repr(v) for v in _versions(request, model)) or "none yet"
            raise ApiError("not_found", f"model {model.spec.name!r} has no version {version!r}; "
                           f"it serves {served}", param="model_version", code="model_not_found")
        request[PINNED] = variant
    return model


def _versions(request: web.Request, model: ServedModel) -> list[str]:
    """A model's versions: the revision of each of its variants (one without an A/B split)."""
    pool = request.app[POOL]
    return list(dict.fromkeys(r for v in model.variants if (r := revision(v, pool))))




def _tensors(model: ServedModel) -> Tensors:
    build = TASKS.get(model.spec.task)
    if build is None:
        raise ApiError("invalid_request", f"model {model.spec.name!r} is a {model.spec.task} "
                       "model; its KServe tensors are not available yet", param="model",
                       code="unsupported_task")
    return build(model)


async def _read(request: web.Request) -> tuple[dict, bytes]:
    raw = await codec.read_raw(request)
    if not raw:
        raise ApiError("bad_request", "empty request body")
    media = codec.media_type(request)
    if media in codec.MSGPACK_TYPES:
        body = await codec.decoded(raw, codec.decode_body, raw, media)
        return tensors.object_of(body, "the inference request"), b""
    if request.headers.get("Content-Type", "").strip() and media not in JSON_TYPES:
        raise ApiError("unsupported_media_type", f"Content-Type {media[:100]!r} is "
                       f"not supported; send {codec.JSON} (or {JSON_TYPES[1]} with Triton's "
                       f"binary data) or {codec.MSGPACK}")
    # Sent twice, as one value ("105, 3"): refused, not the first taken (an outside check)
    lengths = request.headers.getall(HEADER_LENGTH, ())
    return await codec.decoded(raw, tensors.split_body, raw, ", ".join(lengths) or None)


def _inputs(spec: Tensors, given: list[Tensor]) -> dict[str, Tensor]:
    by_name = {t.name: t for t in given}
    expected = {t.name: t for t in spec.inputs}
    if set(by_name) != set(expected) or len(given) != len(by_name):
        raise ApiError("invalid_request", f"inputs must be exactly {sorted(expected)}; got "
                       f"{[t.name for t in given]}", param="inputs")
    for name, tensor in by_name.items():
        want = expected[name]
        if tensor.datatype != want.datatype:
            raise ApiError("invalid_request", f"input {name!r} must be {want.datatype}, not "
                           f"{tensor.datatype}", param="inputs")
        # A batch of scalars: [N], or [N, 1] as clients with a batch dimension send it.
        if len(tensor.shape) == 2 and tensor.shape[1] == 1 and len(want.shape) == 1:
            continue
        if len(tensor.shape) != len(want.shape) or any(
                w != -1 and g != w for g, w in zip(tensor.shape, want.shape)):
            takes = f"{list(want.shape)} (-1: any size)" + (
                f" or {[*want.shape, 1]}" if len(want.shape) == 1 else "")
            raise ApiError("invalid_request", f"input {name!r} has shape {list(tensor.shape)}; "
                           f"expected {takes}", param="inputs")
    return by_name
