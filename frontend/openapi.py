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
from frontend.app import CONFIG, OPEN_PATHS
from frontend.errors import STATUS
from shmserve.config import Config

DOCUMENT = web.AppKey("openapi", dict)

_DESCRIPTION = """\
Embeddings, classification and reranking over shared memory. Protocols: the native `/predict`,
`/v1/classify` and `/v1/rerank`, OpenAI's `/v1/embeddings`, Hugging Face TEI's `/embed`,
`/rerank`, `/tokenize` and `/info`, and KServe v2 (`/v2/...`, with Triton's binary tensor data
extension). Inference responses carry `X-Model-Revision` (and `X-Model-Variant` for an A/B
split).

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


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


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
                       "content": {**_json(_ref(schema)),
                                   "application/msgpack": {"schema": _ref(schema)}}}
        if s in (429, 503):  # overloaded, or no live worker: try again after this long
            out[str(s)]["headers"] = {"Retry-After": {
                "description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
    return out


def _shared_errors(paths: dict[str, dict]) -> dict[str, dict]:
    """Every operation gets 405 (another method on its path, with Allow), and 401 where an API
    key is asked for (auth.api_keys; the open paths never ask; /admin has its own token)."""
    for path, item in paths.items():
        kserve = path.startswith("/v2")
        for op in item.values():
            responses = op["responses"]
            responses.setdefault("405", {"$ref": "#/components/responses/" + (
                "KServeMethodNotAllowed" if kserve else "MethodNotAllowed")})
            if path in OPEN_PATHS:
                op["security"] = [{}]
            elif not path.startswith("/admin/"):
                responses.setdefault(
                    "401", _errors(401, schema="KServeError" if kserve else "Error")["401"])
    return paths


def _method_not_allowed(schema: str) -> dict:
    return {"description": "method not allowed; Allow names the methods the path takes",
            "headers": {"Allow": {"schema": {"type": "string"}}},
            "content": {**_json(_ref(schema)), "application/msgpack": {"schema": _ref(schema)}}}


_POST_ERRORS = (400, 401, 404, 413, 415, 422, 429, 503, 504, 507)


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
            "native", "Embed texts", {**_ok(_ref("PredictResponse")), **_errors(*_POST_ERRORS)},
            _body(_ref("PredictRequest")))},
        "/v1/embeddings": {"post": _op(
            "openai", "OpenAI embeddings", {**_ok(_ref("EmbeddingsResponse")),
                                            **_errors(*_POST_ERRORS)},
            _body(_ref("EmbeddingsRequest")))},
        "/v1/models": {"get": _op("openai", "Served models", _ok(_ref("ModelList")))},
        "/v1/models/{model}": {"get": _op("openai", "One served model, by name or alias", {
            **_ok(_ref("Model")), **_errors(404)}, parameters=[model])},
        "/health": {"get": _op("ops", "Liveness of this frontend", _ok(_ref("Health")))},
        "/ready": {"get": _op("ops", "Whether every served model has a ready worker", {
            **_ok(_ref("Readiness")),
            "503": {"description": "loading, or some model has no ready worker",
                    "content": _json(_ref("Readiness"))}})},
        "/metrics": {"get": _op("ops", "Prometheus metrics", {"200": {
            "description": "Prometheus text exposition",
            "content": {"text/plain": {"schema": {"type": "string"}}}}})},
        "/info": {"get": _op("tei", "Server and model information (TEI's /info)",
                             _ok(_ref("Info")))},
        "/openapi.json": {"get": _op("ops", "This document", _ok({"type": "object"}))},
        "/v1/classify": {"post": _op(
            "native", "Classify texts (a classification model)",
            {**_ok(_ref("ClassifyResponse")), **_errors(*_POST_ERRORS)},
            _body(_ref("ClassifyRequest")))},
        "/v1/rerank": {"post": _op(
            "native", "Rerank documents against a query (a cross-encoder; Cohere's shape)",
            {**_ok(_ref("RerankResponse")), **_errors(*_POST_ERRORS)},
            _body(_ref("RerankRequest")))},
        "/admin/models": {"get": {**_op(
            "admin", "Each model's revision and loading state per worker (loopback only; 404 "
            "when admin.token is unset)", {**_ok({"type": "object"}), **_errors(401, 404)}),
            "security": [{"bearer": []}]}},
        "/admin/models/{name}/reload": {"post": {**_op(
            "admin", "Hot reload: new weights on every worker, switched between batches",
            {**_ok({"type": "object"}), **_errors(401, 404, 409, 422, 500, 503)},
            {"required": False, "content": _json(_ref("ReloadRequest"))},
            [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]),
            "security": [{"bearer": []}]}},
        "/admin/models/{name}/split": {"put": {**_op(
            "admin", "A/B weights of a model with variants, on every frontend",
            {**_ok({"type": "object"}), **_errors(401, 404, 422)},
            _body(_ref("SplitRequest")),
            [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]),
            "security": [{"bearer": []}]}},
        "/embed": {"post": _op(
            "tei", "TEI embed", {**_ok({"type": "array", "items": _ref("Vector")}),
                                 **_errors(*_POST_ERRORS)}, _body(_ref("TeiEmbedRequest")))},
        "/rerank": {"post": _op(
            "tei", "TEI rerank (a cross-encoder)",
            {**_ok({"type": "array", "items": _ref("Rank")}), **_errors(*_POST_ERRORS)},
            _body(_ref("TeiRerankRequest")))},
        "/tokenize": {"post": _op(
            "tei", "TEI tokenize", {**_ok({"type": "array", "items": {
                "type": "array", "items": _ref("SimpleToken")}}), **_errors(*_POST_ERRORS)},
            _body(_ref("TeiTokenizeRequest")))},
        "/v2": {"get": _op("kserve", "Server metadata", _ok(_ref("ServerMetadata")))},
        "/v2/health/live": {"get": _op("kserve", "Server live", _ok(_ref("Live")))},
        "/v2/health/ready": {"get": _op("kserve", "Server ready", {
            **_ok(_ref("Ready")),
            "400": {"description": "not ready", "content": _json(_ref("Ready"))}})},
        **_kserve_paths(model, version),
    }


def _kserve_paths(model: dict, version: dict) -> dict[str, dict]:
    paths: dict[str, dict] = {}
    for prefix, params in (("/v2/models/{model}", [model]),
                           ("/v2/models/{model}/versions/{version}", [model, version])):
        paths[prefix] = {"get": _op("kserve", "Model metadata",
                                    {**_ok(_ref("ModelMetadata")),
                                     **_errors(404, 422, schema="KServeError")},
                                    parameters=params)}
        paths[prefix + "/ready"] = {"get": _op("kserve", "Model ready", {
            **_ok(_ref("ModelReady")),
            "400": {"description": "not ready", "content": _json(_ref("ModelReady"))},
            **_errors(404, schema="KServeError")}, parameters=params)}
        paths[prefix + "/config"] = {"get": _op(
            "kserve", "Triton's model configuration (its JSON form)",
            {**_ok({"type": "object"}), **_errors(404, 422, schema="KServeError")},
            parameters=params)}
        paths[prefix + "/stats"] = {"get": _op(
            "kserve", "Triton's statistics: not kept (404); see GET /metrics",
            _errors(404, schema="KServeError"), parameters=params)}
        paths[prefix + "/infer"] = {"post": _op("kserve", "Inference", {
            "200": {"description": "OK; with binary outputs the body is the JSON header (its "
                    "length in Inference-Header-Content-Length) then the tensor bytes",
                    "headers": {"Inference-Header-Content-Length": {
                        "schema": {"type": "integer"}}},
                    "content": {**_json(_ref("InferenceResponse")),
                                "application/msgpack": {
                                    "schema": _ref("MsgpackInferenceResponse")},
                                "application/octet-stream": {
                                    "schema": {"type": "string", "format": "binary"}}}},
            **_errors(*_POST_ERRORS, schema="KServeError")},
            _body(_ref("InferenceRequest"), "application/octet-stream"), params)}
    paths["/v2/models/stats"] = {"get": _op(
        "kserve", "Triton's statistics of every model: not kept (404); see GET /metrics",
        _errors(404, schema="KServeError"))}
    return paths


def document(cfg: Config) -> dict[str, Any]:
    models = [name for m in cfg.models for name in (m.name, *m.aliases)]  # any other: 404
    return {
        "openapi": "3.1.0",
        "info": {"title": "shmserve", "version": shmserve.__version__,
                 "description": _DESCRIPTION},
        "servers": [{"url": "/"}],
        "tags": [{"name": n} for n in ("native", "openai", "tei", "kserve", "ops", "admin")],
        "paths": _paths(models),
        "components": {"schemas": _schemas(cfg, models), "responses": {
            "MethodNotAllowed": _method_not_allowed("Error"),
            "KServeMethodNotAllowed": _method_not_allowed("KServeError")}, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer", "description": "admin.token"},
            "apiKey": {"type": "http", "scheme": "bearer",
                       "description": "one of auth.api_keys, when the server sets any"}}},
        # Inference routes: a key when the server asks for one (auth.api_keys), else none.
        "security": [{}, {"apiKey": []}],
    }


def _schemas(cfg: Config, models: list[str]) -> dict[str, Any]:
    limits = cfg.limits
    text = {"type": "string", "minLength": 1, "maxLength": limits.max_text_chars}
    texts = {"type": "array", "items": text, "minItems": 1,
             "maxItems": limits.max_texts_per_request}
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    parts = {
        "text": text, "texts": texts,
        "inputs": {"oneOf": [text, texts, ids, {"type": "array", "items": ids, "minItems": 1,
                                                "maxItems": limits.max_texts_per_request}],
                   "description": "text(s), or token ids the client made: used as given (no "
                                  "special tokens added), each in [0, vocab size)"},
        # Per route, the models of its task (the null model stands in for an embedding one).
        "model": lambda *tasks: _model_names(cfg, tasks),
    }
    return {**_native_schemas(parts), **_task_schemas(parts), **_tei_schemas(parts),
            **_kserve_schemas()}


def _model_names(cfg: Config, tasks: tuple[str, ...]) -> dict[str, Any]:
    names = [n for m in cfg.models if m.task in tasks for n in (m.name, *m.aliases)]
    schema: dict[str, Any] = {"type": "string", "description": "a served model's name or alias, "
                              f"of task {' or '.join(tasks)}; the first model of the route's "
                              "task when absent"}
    if names:  # else any name is 404 or 422 (unsupported_task)
        schema["enum"] = names
    return schema


def _native_schemas(parts: dict[str, Any]) -> dict[str, Any]:
    """The native and OpenAI bodies, errors, and the operational routes' answers."""
    priority = {"oneOf": [{"enum": ["low", "normal", "high"]},
                          {"type": "integer", "minimum": -10, "maximum": 10}],
                "description": "higher runs first; wins over the X-Priority header"}
    usage = {"type": "object", "properties": {"prompt_tokens": {"type": "integer"},
                                               "total_tokens": {"type": "integer"}}}
    return {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"], "properties": {
                "message": {"type": "string"},
                "type": {"type": "string", "description": "bad_request, invalid_request, "
                         "not_found, too_large, overloaded, timeout, unavailable, ..."},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]}}}}},
        "Vector": {"oneOf": [{"type": "array", "items": {"type": "number"}},
                             {"type": "string", "description": "base64 (encoding_format) or, in "
                              "msgpack, raw little-endian float32 bytes"}]},
        "PredictRequest": {"type": "object", "required": ["texts"], "properties": {
            "texts": {"oneOf": [parts["text"], parts["texts"]],
                      "description": "one string is one text: `results` holds one row"},
            "model": parts["model"]("embedding", "null", "classification"),
            "priority": priority, "top_k": {"type": ["integer", "null"], "minimum": 1,
                      "description": "a classification model: labels per text"},
            "user": {"type": ["string", "null"]}}},
        "PredictResponse": {"type": "object", "properties": {
            "results": {"type": "array", "description": "a vector per text, or for a "
                        "classification model its labels, best first", "items": {"oneOf": [
                            _ref("Vector"), {"type": "array", "items": {
                                "type": "object", "properties": {
                                    "label": {"type": "string"},
                                    "score": {"type": "number"}}}}]}},
            "model": {"type": "string"},
            "revision": {"type": "string"}, "usage": usage}},
        "EmbeddingsRequest": {"type": "object", "required": ["input"], "properties": {
            "input": parts["inputs"], "model": parts["model"]("embedding", "null"),
            "encoding_format": {"type": ["string", "null"], "enum": ["float", "base64", None]},
            "dimensions": {"type": ["integer", "null"], "minimum": 1,
                           "description": "keep this many leading components, re-normalised "
                                          "(Matryoshka); at most the model's dimension"},
            "user": {"type": ["string", "null"]}, "priority": priority}},
        "EmbeddingsResponse": {"type": "object", "properties": {
            "object": {"const": "list"}, "model": {"type": "string"}, "usage": usage,
            "data": {"type": "array", "items": {"type": "object", "properties": {
                "object": {"const": "embedding"}, "index": {"type": "integer"},
                "embedding": _ref("Vector")}}}}},
        "Model": {"type": "object", "properties": {
            "id": {"type": "string"}, "object": {"const": "model"},
            "created": {"type": "integer"}, "owned_by": {"type": "string"}}},
        "ModelList": {"type": "object", "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}},
        "Health": {"type": "object", "properties": {"status": {"type": "string"},
                                                    "version": {"type": "string"}}},
        "Readiness": {"type": "object", "properties": {
            "status": {"enum": ["ready", "degraded", "loading", "unavailable"]},
            "workers": {"type": "array", "items": {"type": "object"}}}},
    }


def _task_schemas(parts: dict[str, Any]) -> dict[str, Any]:
    """Classification, rerank and the model admin bodies (docs/models.md)."""
    count = {"type": ["integer", "null"], "minimum": 1}
    usage = {"type": "object", "properties": {"prompt_tokens": {"type": "integer"},
                                               "total_tokens": {"type": "integer"}}}
    scored = {"type": "object", "properties": {"label": {"type": "string"},
                                               "score": {"type": "number"}}}
    document = {"oneOf": [parts["text"], {"type": "object", "required": ["text"],
                                          "properties": {"text": parts["text"]}}]}
    return {
        "ClassifyRequest": {"type": "object", "required": ["input"], "properties": {
            "input": {"oneOf": [parts["text"], parts["texts"]]},
            "model": parts["model"]("classification"), "top_k": count,
            "user": {"type": ["string", "null"]}}},
        "ClassifyResponse": {"type": "object", "properties": {
            "object": {"const": "list"}, "model": {"type": "string"},
            "revision": {"type": "string"}, "usage": usage,
            "data": {"type": "array", "items": {"type": "object", "properties": {
                "object": {"const": "classification"}, "index": {"type": "integer"},
                "label": {"type": "string"}, "num_classes": {"type": "integer"},
                "probs": {"type": "array", "items": {"type": "number"}},
                "labels": {"type": "array", "items": scored,
                           "description": "best first, cut to top_k"}}}}}},
        "RerankRequest": {"type": "object", "required": ["query", "documents"], "properties": {
            "query": parts["text"], "model": parts["model"]("rerank"),
            "documents": {"type": "array", "items": document, "minItems": 1,
                          "maxItems": parts["texts"]["maxItems"]},
            "top_n": count, "return_documents": {"type": ["boolean", "null"]},
            "user": {"type": ["string", "null"]}}},
        "RerankResponse": {"type": "object", "properties": {
            "id": {"type": "string"}, "model": {"type": "string"},
            "revision": {"type": "string"}, "usage": usage,
            "results": {"type": "array", "description": "best first", "items": {
                "type": "object", "properties": {
                    "index": {"type": "integer"}, "relevance_score": {"type": "number"},
                    "document": {"type": "object", "properties": {
                        "text": {"type": "string"}}}}}}}},
        "ReloadRequest": {"type": "object", "properties": {
            "source": {"type": "string", "description": "a directory under model_roots or "
                       "package:NAME; empty: the current source, read again"},
            "revision": {"type": "string", "description": "empty: a digest of the weights"},
            "variant": {"type": "string", "description": "the A/B variant, for a split model"}}},
        "SplitRequest": {"type": "object", "required": ["weights"], "properties": {
            "weights": {"type": "object", "additionalProperties": {
                "type": "number", "minimum": 0}}}},
    }


def _tei_schemas(parts: dict[str, Any]) -> dict[str, Any]:
    nullable_bool = {"type": ["boolean", "null"]}
    direction = {"type": ["string", "null"], "enum": ["Right", "Left", "right", "left", None]}
    return {
        "Info": {"type": "object", "properties": {
            "model_id": {"type": "string"}, "model_sha": {"type": ["string", "null"]},
            "model_dtype": {"type": "string"}, "model_type": {"type": "object"},
            "max_concurrent_requests": {"type": "integer"},
            "max_input_length": {"type": "integer"}, "max_batch_tokens": {"type": "integer"},
            "max_batch_requests": {"type": ["integer", "null"]},
            "max_client_batch_size": {"type": "integer"}, "auto_truncate": {"type": "boolean"},
            "tokenization_workers": {"type": "integer"}, "version": {"type": "string"}}},
        "TeiEmbedRequest": {"type": "object", "required": ["inputs"], "properties": {
            "inputs": parts["inputs"], "model": parts["model"]("embedding", "null"),
            "normalize": nullable_bool,
            "truncate": nullable_bool, "truncation_direction": direction,
            "dimensions": {"type": ["integer", "null"], "minimum": 1},
            "prompt_name": {"type": "null"}}},
        "TeiRerankRequest": {"type": "object", "required": ["query", "texts"], "properties": {
            "query": parts["text"], "texts": parts["texts"], "model": parts["model"]("rerank"),
            "raw_scores": nullable_bool, "return_text": nullable_bool,
            "truncate": nullable_bool, "truncation_direction": direction}},
        "Rank": {"type": "object", "properties": {"index": {"type": "integer"},
                                                  "score": {"type": "number"},
                                                  "text": {"type": "string"}}},
        "TeiTokenizeRequest": {"type": "object", "required": ["inputs"], "properties": {
            "inputs": {"oneOf": [parts["text"], parts["texts"]]},
            "model": parts["model"]("embedding", "null", "classification", "rerank"),
            "add_special_tokens": nullable_bool, "prompt_name": {"type": "null"}}},
        "SimpleToken": {"type": "object", "properties": {
            "id": {"type": "integer"}, "text": {"type": "string"}, "special": {"type": "boolean"},
            "start": {"type": ["integer", "null"]}, "stop": {"type": ["integer", "null"]}}},
    }


def _kserve_schemas() -> dict[str, Any]:
    tensor_meta = {"type": "object", "properties": {
        "name": {"type": "string"}, "datatype": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}}}}
    tensor = {"type": "object", "required": ["name", "datatype", "shape"], "properties": {
        "name": {"type": "string"}, "datatype": {"type": "string", "example": "BYTES"},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "parameters": {"type": "object", "properties": {
            "binary_data_size": {"type": "integer", "minimum": 0}}},
        "data": {"type": "array", "description": "row-major, flat or nested"}}}
    return {
        "KServeError": {"type": "object", "required": ["error"], "properties": {
            "error": {"type": "string"}}},
        "ServerMetadata": {"type": "object", "properties": {
            "name": {"type": "string"}, "version": {"type": "string"},
            "extensions": {"type": "array", "items": {"type": "string"}}}},
        "Live": {"type": "object", "properties": {"live": {"type": "boolean"}}},
        "Ready": {"type": "object", "properties": {"ready": {"type": "boolean"}}},
        "ModelReady": {"type": "object", "properties": {"name": {"type": "string"},
                                                        "ready": {"type": "boolean"}}},
        "ModelMetadata": {"type": "object", "properties": {
            "name": {"type": "string"},
            "versions": {"type": "array", "items": {"type": "string"}},
            "platform": {"type": "string"},
            "inputs": {"type": "array", "items": tensor_meta},
            "outputs": {"type": "array", "items": tensor_meta}}},
        "InferenceRequest": {"type": "object", "required": ["inputs"], "properties": {
            "id": {"type": "string"},
            "parameters": {"type": "object", "properties": {
                "binary_data_output": {"type": "boolean"}}},
            "inputs": {"type": "array", "minItems": 1, "items": tensor},
            "outputs": {"type": "array", "items": {
                "type": "object", "required": ["name"], "properties": {
                    "name": {"type": "string"}, "parameters": {"type": "object", "properties": {
                        "binary_data": {"type": "boolean"}}}}}}}},
        "InferenceResponse": {"type": "object", "properties": {
            "model_name": {"type": "string"}, "model_version": {"type": "string"},
            "id": {"type": "string"}, "outputs": {"type": "array", "items": tensor}}},
        "MsgpackInferenceResponse": {"type": "object", "properties": {
            "model_name": {"type": "string"}, "model_version": {"type": "string"},
            "id": {"type": "string"}, "outputs": {"type": "array", "items": {
                **tensor, "properties": {**tensor["properties"], "data": {
                    "oneOf": [{"type": "string", "format": "binary"},
                              {"type": "array", "items": {"type": "string"}}],
                    "description": "a bin of the tensor's raw little-endian bytes, row-major "
                                   "(np.frombuffer(data, '<f4')); a BYTES output stays a list"
                }}}}}},
    }
