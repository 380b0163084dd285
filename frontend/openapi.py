"""``GET /openapi.json``: an OpenAPI 3.1 document of every public route, written by hand.

It is built once per process from the config, so it names the served models (and their
aliases; each route's `model` lists the models of its task) and its limits (texts per request,
characters per text) are the ones enforced. Every POST body may be JSON or msgpack; every error
is the `Error` schema (OpenAI's shape), but under /v2 `KServeError` (that protocol's). Every
operation may answer 405 (another method on its path) and, but on the open paths, 401 when the
server sets auth.api_keys.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

import shmserve
from frontend import codec
from frontend import openapi_schemas as components
from frontend.app import CONFIG, OPEN_PATHS
from frontend.errors import STATUS, kserve_shaped
from frontend.openapi_schemas import ref
from shmserve.config import Config

DOCUMENT = web.AppKey("openapi", dict)

_DESCRIPTION = """\
Embeddings, classification and reranking over shared memory. Protocols: the native `/predict`,
`/v1/classify` and `/v1/rerank` (also Cohere's `/v2/rerank`), Cohere's `/v1/embed` and
`/v2/embed`, OpenAI's `/v1/embeddings`, Hugging Face TEI's `/embed`, `/embed_all`,
`/embed_sparse`, `/similarity`, `/` (as TEI's, for huggingface_hub), `/rerank`, `/tokenize`,
`/decode` and `/info`, infinity's `/embeddings`, `/rerank` (with `documents`) and `/classify`,
and KServe v2 (`/v2/...`, with Triton's binary tensor data
extension).
Inference responses carry `X-Model-Revision` (and `X-Model-Variant` for an A/B split).

Every POST body may be JSON (`Content-Type: application/json`) or msgpack
(`application/msgpack`); a response is msgpack when `Accept` names msgpack, and then float vectors
are raw little-endian float32 bytes. Request headers: `X-Request-ID` (echoed back; one is made
when absent), `X-Request-Timeout` (seconds, in (0, 3600]: the request's deadline) and
`X-Priority` (low, normal, high or an integer in [-10, 10]).
Errors, from every route and from nginx: `{"error": {"message", "type", "param", "code"}}`;
under `/v2` KServe's `{"error": "<message>"}`.
"""


def add_routes(app: web.Application) -> None:
    app[DOCUMENT] = document(app[CONFIG])
    app.router.add_get("/openapi.json", openapi_json)


async def openapi_json(request: web.Request) -> web.Response:
    return codec.render(request, request.app[DOCUMENT])


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _body(schema: dict, *extra: str) -> dict:
    content = {"application/json": {"schema": schema},
               "application/msgpack": {"schema": schema}}
    for media in extra:
        content[media] = {"schema": {"type": "string", "format": "binary"}}
    return {"required": True, "content": content}


def _errors(*statuses: int, schema: str = "Error") -> dict[str, dict]:
    reasons = {code: kind for kind, code in STATUS.items()}
    out: dict[str, dict] = {}
    for s in statuses:
        out[str(s)] = {"description": reasons.get(s, "error").replace("_", " "),
                       "content": {**_json(ref(schema)),
                                   "application/msgpack": {"schema": ref(schema)}}}
        if s in (429, 503):  # overloaded, or no live worker: try again after this long
            out[str(s)]["headers"] = {"Retry-After": {
                "description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
    return out


def _shared_errors(paths: dict[str, dict]) -> dict[str, dict]:
    """Every operation gets 405 (another method on its path, with Allow), 500 (anything
    unexpected, its message quoting the request id) and 502 (nginx: no frontend answered),
    which the README's table of errors names and the document left out (an outside check),
    and 401 where an API key is asked for (auth.api_keys; the open paths never ask; /admin has
    its own token)."""
    for path, item in paths.items():
        kserve = kserve_shaped(path)
        for op in item.values():
            responses = op["responses"]
            prefix = "#/components/responses/" + ("KServe" if kserve else "")
            responses.setdefault("405", {"$ref": prefix + "MethodNotAllowed"})
            responses.setdefault("500", {"$ref": prefix + "InternalError"})
            responses.setdefault("502", {"$ref": prefix + "NoFrontend"})
            if path in OPEN_PATHS:
                op["security"] = [{}]
            elif not path.startswith("/admin/"):
                responses.setdefault(
                    "401", _errors(401, schema="KServeError" if kserve else "Error")["401"])
    return paths


def _method_not_allowed(schema: str) -> dict:
    return {"description": "method not allowed; Allow names the methods the path takes",
            "headers": {"Allow": {"schema": {"type": "string"}}},
            "content": {**_json(ref(schema)), "application/msgpack": {"schema": ref(schema)}}}


def _no_frontend(schema: str) -> dict:
    return {"description": "no frontend answered (nginx's own page): try again after "
                           "Retry-After",
            "headers": {"Retry-After": {"description": "seconds to wait before retrying",
                                        "schema": {"type": "integer"}}},
            "content": {**_json(ref(schema)), "application/msgpack": {"schema": ref(schema)}}}


_POST_ERRORS = (400, 401, 404, 413, 415, 422, 429, 503, 504, 507)
# OpenAI's and Cohere's routes: 400 instead (errors.status_on)
_OPENAI_ERRORS = tuple(s for s in _POST_ERRORS if s != 422)


def _ok(schema: dict, description: str = "OK", **more: Any) -> dict:
    return {"200": {"description": description, "content": {
        **_json(schema), "application/msgpack": {"schema": schema}}, **more}}


def _op(tag: str, summary: str, responses: dict, body: dict | None = None,
        parameters: list | None = None) -> dict:
    op: dict[str, Any] = {"tags": [tag], "summary": summary, "responses": responses}
    if body is not None:
        op["requestBody"] = body
    if parameters:
        op["parameters"] = parameters
    return op


def _paths(models: list[str]) -> dict[str, dict]:
    model = {"name": "model", "in": "path", "required": True, "example": models[0],
             "schema": {"enum": models}}
    return _shared_errors(_routes(model))


def _routes(model: dict) -> dict[str, dict]:
    version = {"name": "version", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "/predict": {"post": _op(
            "native", "Embed or classify texts (`texts`); TEI's classification body "
            "(`inputs`: texts and pairs) on a classification model",
            {**_ok({"oneOf": [ref("PredictResponse"), {"type": "array", "items": ref(
                "Prediction")}, {"type": "array", "items": {"type": "array", "items": ref(
                    "Prediction")}}]}), **_errors(*_POST_ERRORS)},
            _body({"oneOf": [ref("PredictRequest"), ref("TeiPredictRequest")]}))},
        "/v1/embeddings": {"post": _op(
            "openai", "OpenAI embeddings", {**_ok(ref("EmbeddingsResponse")),
                                            **_errors(*_OPENAI_ERRORS)},
            _body(ref("EmbeddingsRequest")))},
        "/v1/models": {"get": _op("openai", "Served models", _ok(ref("ModelList")))},
        "/v1/models/{model}": {"get": _op("openai", "One served model, by name or alias", {
            **_ok(ref("Model")), **_errors(404)}, parameters=[model])},
        "/health": {"get": _op("ops", "Liveness of this frontend", _ok(ref("Health")))},
        "/ready": {"get": _op("ops", "Whether every served model has a ready worker", {
            **_ok(ref("Readiness")),
            "503": {"description": "loading, or some model has no ready worker",
                    "headers": {"Retry-After": {"description": "seconds to wait before asking "
                                                "again", "schema": {"type": "integer"}}},
                    "content": _json(ref("Readiness"))}})},
        "/metrics": {"get": _op("ops", "Prometheus metrics", {"200": {
            "description": "Prometheus text exposition",
            "content": {"text/plain": {"schema": {"type": "string"}}}}})},
        "/info": {"get": _op("tei", "Server and model information (TEI's /info)",
                             _ok(ref("Info")))},
        "/openapi.json": {"get": _op("ops", "This document", _ok({"type": "object"}))},
        "/v1/classify": {"post": _op(
            "native", "Classify texts (a classification model)",
            {**_ok(ref("ClassifyResponse")), **_errors(*_POST_ERRORS)},
            _body(ref("ClassifyRequest")))},
        "/v1/rerank": {"post": _op(
            "native", "Rerank documents against a query (a cross-encoder; Cohere's shape)",
            {**_ok(ref("RerankResponse")), **_errors(*_POST_ERRORS)},
            _body(ref("RerankRequest")))},
        "/v1/embed": {"post": _op(
            "native", "Embed, as Cohere's v1 client sends it (floats, or by embedding_types)",
            {**_ok(ref("CohereEmbedResponse")), **_errors(*_OPENAI_ERRORS)},
            _body(ref("CohereEmbedRequest")))},
        "/v2/embed": {"post": _op(
            "native", "Embed, as Cohere's v2 client sends it (by type: float, int8, uint8, "
            "binary, ubinary, base64)",
            {**_ok(ref("CohereEmbedResponse")), **_errors(*_OPENAI_ERRORS)},
            _body(ref("CohereEmbedRequest")))},
        "/v2/rerank": {"post": _op(
            "native", "Rerank, as Cohere's v2 client sends it (the answer adds Cohere's meta)",
            {**_ok(ref("RerankResponse")), **_errors(*_OPENAI_ERRORS)},
            _body(ref("RerankRequest")))},
        "/admin/models": {"get": {**_op(
            "admin", "Each model's revision and loading state per worker (loopback only; 404 "
            "when admin.token is unset)", {**_ok({"type": "object"}), **_errors(401, 403, 404)}),
            "security": [{"bearer": []}]}},
        "/admin/models/{name}/reload": {"post": {**_op(
            "admin", "Hot reload: new weights on every worker, switched between batches",
            {**_ok({"type": "object"}), **_errors(401, 403, 404, 409, 422, 500, 503)},
            {"required": False, "content": _json(ref("ReloadRequest"))},
            [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]),
            "security": [{"bearer": []}]}},
        "/admin/models/{name}/split": {"put": {**_op(
            "admin", "A/B weights of a model with variants, on every frontend",
            {**_ok({"type": "object"}), **_errors(401, 403, 404, 422)},
            _body(ref("SplitRequest")),
            [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]),
            "security": [{"bearer": []}]}},
        "/embed": {"post": _op(
            "tei", "TEI embed", {**_ok({"type": "array", "items": ref("Vector")}),
                                 **_errors(*_POST_ERRORS)}, _body(ref("TeiEmbedRequest")))},
        "/embed_all": {"post": _op(
            "tei", "TEI embed_all: every token's last hidden state (special and prompt tokens "
            "included; not pooled or normalised), one list of rows per input; 413 when the "
            "rows would take over a quarter of the frontend's shared memory (shm.arena_mb)",
            {**_ok({"type": "array", "items": {"type": "array", "items": ref("Vector")}}),
             **_errors(*_POST_ERRORS)}, _body(ref("TeiEmbedAllRequest")))},
        "/embed_sparse": {"post": _op(
            "tei", "TEI embed_sparse: a sparse model's SPLADE vector per input, its non-zero "
            "values by vocabulary index in index order; 413 when the vocabulary-wide rows "
            "would take over a quarter of the frontend's shared memory (shm.arena_mb)",
            {**_ok({"type": "array", "items": {"type": "array", "items": ref("SparseValue")}}),
             **_errors(*_POST_ERRORS)}, _body(ref("TeiEmbedSparseRequest")))},
        "/similarity": {"post": _op(
            "tei", "TEI similarity: cosine of each sentence to the source sentence",
            {**_ok({"type": "array", "items": {"type": "number"}}), **_errors(*_POST_ERRORS)},
            _body(ref("TeiSimilarityRequest")))},
        "/": {"post": _op(
            "tei", "TEI's route for the model's task (huggingface_hub's InferenceClient posts "
            "here): a similarity body as /similarity, a text-classification body (with "
            "`parameters`) on a classification model, a rerank body (`query`, `texts`) as "
            "/rerank, any other as /embed",
            {**_ok({"oneOf": [{"type": "array", "items": ref("Vector")},
                              {"type": "array", "items": {"type": "number"}},
                              {"type": "array", "items": {"type": "array", "items": {
                                  "type": "object", "properties": {
                                      "label": {"type": "string"},
                                      "score": {"type": "number"}}}}},
                              {"type": "array", "items": ref("Rank")}]}),
             **_errors(*_POST_ERRORS)},
            _body({"oneOf": [ref("TeiEmbedRequest"), ref("TeiSimilarityRequest"),
                             ref("HubClassifyRequest"), ref("TeiRerankRequest")]}))},
        "/rerank": {"post": _op(
            "tei", "TEI rerank (a cross-encoder); a body with `documents` instead of `texts` "
            "is infinity's (its answer's shape too)",
            {**_ok({"oneOf": [{"type": "array", "items": ref("Rank")},
                              ref("InfinityRerankResponse")]}), **_errors(*_POST_ERRORS)},
            _body({"oneOf": [ref("TeiRerankRequest"), ref("InfinityRerankRequest")]}))},
        "/embeddings": {"post": _op(
            "infinity", "OpenAI embeddings at infinity's path (as /v1/embeddings)",
            {**_ok(ref("EmbeddingsResponse")), **_errors(*_OPENAI_ERRORS)},
            _body(ref("InfinityEmbeddingsRequest")))},
        "/models": {"get": _op(
            "infinity", "Served models, as infinity lists them (capabilities, stats)",
            _ok({"type": "object", "properties": {"data": {"type": "array", "items": {
                "type": "object"}}}}))},
        "/classify": {"post": _op(
            "infinity", "Classify texts, as infinity answers (every label, best first)",
            {**_ok(ref("InfinityClassifyResponse")), **_errors(*_POST_ERRORS)},
            _body(ref("InfinityClassifyRequest")))},
        "/tokenize": {"post": _op(
            "tei", "TEI tokenize", {**_ok({"type": "array", "items": {
                "type": "array", "items": ref("SimpleToken")}}), **_errors(*_POST_ERRORS)},
            _body(ref("TeiTokenizeRequest")))},
        "/decode": {"post": _op(
            "tei", "TEI decode: token ids back to text", {
                **_ok({"type": "array", "items": {"type": "string"}}), **_errors(*_POST_ERRORS)},
            _body(ref("TeiDecodeRequest")))},
        "/v2": {"get": _op("kserve", "Server metadata", _ok(ref("ServerMetadata")))},
        "/v2/health/live": {"get": _op("kserve", "Server live", _ok(ref("Live")))},
        "/v2/health/ready": {"get": _op("kserve", "Server ready", {
            **_ok(ref("Ready")),
            "400": {"description": "not ready", "content": _json(ref("Ready"))}})},
        **_kserve_paths(model, version),
    }


def _kserve_paths(model: dict, version: dict) -> dict[str, dict]:
    paths: dict[str, dict] = {}
    for prefix, params in (("/v2/models/{model}", [model]),
                           ("/v2/models/{model}/versions/{version}", [model, version])):
        paths[prefix] = {"get": _op("kserve", "Model metadata",
                                    {**_ok(ref("ModelMetadata")),
                                     **_errors(404, 422, schema="KServeError")},
                                    parameters=params)}
        paths[prefix + "/ready"] = {"get": _op("kserve", "Model ready", {
            **_ok(ref("ModelReady")),
            "400": {"description": "not ready", "content": _json(ref("ModelReady"))},
            **_errors(404, 422, schema="KServeError")}, parameters=params)}
        paths[prefix + "/config"] = {"get": _op(
            "kserve", "Triton's model configuration (its JSON form)",
            {**_ok({"type": "object"}), **_errors(404, 422, schema="KServeError")},
            parameters=params)}
        paths[prefix + "/stats"] = {"get": _op(
            "kserve", "Triton's statistics of the model (every version it serves) or version",
            {**_ok(ref("ModelStatistics")), **_errors(404, schema="KServeError")},
            parameters=params)}
        paths[prefix + "/infer"] = {"post": _op("kserve", "Inference", {
            "200": {"description": "OK; with binary outputs the body is the JSON header (its "
                    "length in Inference-Header-Content-Length) then the tensor bytes",
                    "headers": {"Inference-Header-Content-Length": {
                        "schema": {"type": "integer"}}},
                    "content": {**_json(ref("InferenceResponse")),
                                "application/msgpack": {
                                    "schema": ref("MsgpackInferenceResponse")},
                                "application/octet-stream": {
                                    "schema": {"type": "string", "format": "binary"}}}},
            **_errors(*_POST_ERRORS, schema="KServeError")},
            _body(ref("InferenceRequest"), "application/octet-stream"), params)}
    paths["/v2/models/stats"] = {"get": _op(
        "kserve", "Triton's statistics of every model", _ok(ref("ModelStatistics")))}
    index_body = _body({"type": "object", "properties": {"ready": {"type": "boolean"}}})
    paths["/v2/repository/index"] = {"post": _op(
        "kserve", "Triton's model repository index: every model's versions and their state "
        "(READY, LOADING, UNAVAILABLE with its reason); the body is optional",
        {**_ok({"type": "array", "items": ref("RepositoryModel")}),
         **_errors(400, 415, 422, schema="KServeError")}, {**index_body, "required": False})}
    for change in ("load", "unload"):
        paths[f"/v2/repository/models/{{model}}/{change}"] = {"post": _op(
            "kserve", f"Triton's explicit {change}: refused (400), the config says what is "
            "served (`shmserve apply`; new weights: POST /admin/models/{model}/reload)",
            _errors(400, 404, schema="KServeError"), parameters=[model])}
    return paths


def document(cfg: Config) -> dict[str, Any]:
    models = [name for m in cfg.models for name in (m.name, *m.aliases)]  # any other: 404
    return {
        "openapi": "3.1.0",
        "info": {"title": "shmserve", "version": shmserve.__version__,
                 "description": _DESCRIPTION},
        "servers": [{"url": "/"}],
        "tags": [{"name": n} for n in ("native", "openai", "tei", "infinity", "kserve", "ops",
                                       "admin")],
        "paths": _paths(models),
        "components": {"schemas": components.schemas(cfg, models), "responses": {
            "MethodNotAllowed": _method_not_allowed("Error"),
            "KServeMethodNotAllowed": _method_not_allowed("KServeError"),
            "InternalError": _errors(500)["500"],
            "KServeInternalError": _errors(500, schema="KServeError")["500"],
            "NoFrontend": _no_frontend("Error"),
            "KServeNoFrontend": _no_frontend("KServeError")}, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer", "description": "admin.token"},
            "apiKey": {"type": "http", "scheme": "bearer",
                       "description": "one of auth.api_keys, when the server sets any"}}},
        # Inference routes: a key when the server asks for one (auth.api_keys), else none.
        "security": [{}, {"apiKey": []}],
    }
