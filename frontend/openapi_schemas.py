"""The component schemas of ``GET /openapi.json`` (frontend.openapi): each route's request and
response bodies, per protocol, with the limits and model names of this config."""

from __future__ import annotations

from typing import Any

from shmserve.config import Config


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def schemas(cfg: Config, models: list[str]) -> dict[str, Any]:
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
        "priority": {"oneOf": [{"type": "string",  # as shmserve.protocol.priority_level
                                "pattern": "^\\s*([Ll][Oo][Ww]|[Nn][Oo][Rr][Mm][Aa][Ll]|"
                                           "[Hh][Ii][Gg][Hh]|[+-]?[0-9]+)\\s*$"},
                               {"type": "null"},
                               {"type": "integer", "minimum": -10, "maximum": 10}],
                     "description": "low, normal or high (any case), or -10 to 10 (a number or its "
                                    "text): higher runs first; wins over the X-Priority header"},
        "user": {"type": ["string", "null"], "description": "a client id: an A/B split may "
                 "route by it (models.sticky_key)"},
        "prompt_name": {"type": ["string", "null"], "description": "one of the model's "
                        "prompts (models[].prompts and its sentence-transformers config, listed "
                        "in GET /info), put before each text; null: its default prompt, if "
                        "any; \"\": no prompt. Not with token ids"},
    }
    return {**_native_schemas(parts), **_task_schemas(parts), **_tei_schemas(parts),
            **_infinity_schemas(parts), **_kserve_schemas()}


def _infinity_schemas(parts: dict[str, Any]) -> dict[str, Any]:
    """infinity's /rerank (with `documents`) and /classify (frontend.infinity)."""
    flag = {"type": ["boolean", "null"]}
    scheduling = {"priority": parts["priority"], "user": parts["user"]}
    usage = {"type": "object", "properties": {"prompt_tokens": {"type": "integer"},
                                              "total_tokens": {"type": "integer"}}}
    answer = {"model": {"type": "string"}, "usage": usage, "id": {"type": "string"},
              "created": {"type": "integer"}}
    return {
        "InfinityRerankRequest": {"type": "object", "required": ["query", "documents"],
                                  "properties": {
            **scheduling, "query": parts["text"], "documents": parts["texts"],
            "model": parts["model"]("rerank"), "top_n": {"type": ["integer", "null"],
                                                         "minimum": 1},
            "return_documents": flag, "raw_scores": flag}},
        "InfinityRerankResponse": {"type": "object", "properties": {
            "object": {"const": "rerank"}, **answer, "results": {"type": "array", "items": {
                "type": "object", "properties": {
                    "relevance_score": {"type": "number"}, "index": {"type": "integer"},
                    "document": {"type": ["string", "null"]}}}}}},
        "InfinityClassifyRequest": {"type": "object", "required": ["input"], "properties": {
            **scheduling, "input": parts["texts"], "model": parts["model"]("classification"),
            "raw_scores": flag}},
        "InfinityClassifyResponse": {"type": "object", "properties": {
            "object": {"const": "classify"}, **answer, "data": {"type": "array", "items": {
                "type": "array", "items": {"type": "object", "properties": {
                    "score": {"type": "number"}, "label": {"type": "string"}}}}}}},
    }


def _model_names(cfg: Config, tasks: tuple[str, ...]) -> dict[str, Any]:
    names = [n for m in cfg.models if m.task in tasks for n in (m.name, *m.aliases)]
    schema: dict[str, Any] = {"type": ["string", "null"], "minLength": 1,
                              "description": "a served model's "
                              f"name or alias, of task {' or '.join(tasks)}; the first model of "
                              "the route's task when absent or null"}
    if names:  # else any name is 404 or 422 (unsupported_task)
        schema["enum"] = [*names, None]
    return schema


def _native_schemas(parts: dict[str, Any]) -> dict[str, Any]:
    """The native and OpenAI bodies, errors, and the operational routes' answers."""
    priority = parts["priority"]
    usage = {"type": "object", "properties": {"prompt_tokens": {"type": "integer"},
                                               "total_tokens": {"type": "integer"}}}
    embeddings = {  # OpenAI's body, and infinity's (dimensions 0 and modality besides)
        "input": parts["inputs"], "model": parts["model"]("embedding", "null"),
        "encoding_format": {"type": ["string", "null"], "enum": ["float", "base64", None]},
        "user": parts["user"], "priority": priority, "prompt_name": parts["prompt_name"]}
    dimensions = {"type": ["integer", "null"], "description": "keep this many leading "
                  "components, re-normalised (Matryoshka); at most the model's dimension"}
    return {
        "Error": {"type": "object", "required": ["error", "message"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"], "properties": {
                "message": {"type": "string"},
                "type": {"type": "string", "description": "bad_request, invalid_request, "
                         "not_found, too_large, overloaded, timeout, unavailable, ..."},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]}}},
            "message": {"type": "string", "description": "error.message again, where TEI's "
                        "OpenAI-compatible route and Cohere's API put it"}}},
        "Vector": {"oneOf": [{"type": "array", "items": {"type": "number"}},
                             {"type": "string", "description": "base64 (encoding_format) or, in "
                              "msgpack, raw little-endian float32 bytes"}]},
        "PredictRequest": {"type": "object", "required": ["texts"], "properties": {
            "texts": {"oneOf": [parts["text"], parts["texts"]],
                      "description": "one string is one text: `results` holds one row"},
            "model": parts["model"]("embedding", "null", "classification"),
            "priority": priority, "top_k": {"type": ["integer", "null"], "minimum": 1,
                      "description": "a classification model: labels per text"},
            "user": parts["user"], "prompt_name": parts["prompt_name"]}},
        "PredictResponse": {"type": "object", "properties": {
            "results": {"type": "array", "description": "a vector per text, or for a "
                        "classification model its labels, best first", "items": {"oneOf": [
                            ref("Vector"), {"type": "array", "items": {
                                "type": "object", "properties": {
                                    "label": {"type": "string"},
                                    "score": {"type": "number"}}}}]}},
            "model": {"type": "string"},
            "revision": {"type": "string"}, "usage": usage}},
        "EmbeddingsRequest": {"type": "object", "required": ["input"], "properties": {
            **embeddings, "dimensions": {**dimensions, "minimum": 1}}},
        "InfinityEmbeddingsRequest": {"type": "object", "required": ["input"], "properties": {
            **embeddings, "dimensions": {**dimensions, "minimum": 0, "description": (
                dimensions["description"] + "; 0: the model's whole vector (infinity's "
                "default)")}, "modality": {"type": ["string", "null"], "enum": ["text", None]}}},
        "EmbeddingsResponse": {"type": "object", "properties": {
            "object": {"const": "list"}, "model": {"type": "string"}, "usage": usage,
            "revision": {"type": "string", "description": "the served weights' revision"},
            "data": {"type": "array", "items": {"type": "object", "properties": {
                "object": {"const": "embedding"}, "index": {"type": "integer"},
                "embedding": ref("Vector")}}}}},
        "Model": {"type": "object", "properties": {
            "id": {"type": "string"}, "object": {"const": "model"},
            "created": {"type": "integer"}, "owned_by": {"type": "string"}}},
        "ModelList": {"type": "object", "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": ref("Model")}}},
        "Health": {"type": "object", "properties": {"status": {"type": "string"},
                                                    "version": {"type": "string"},
                                                    "protocol": {"type": "integer"}}},
        "Readiness": {"type": "object", "properties": {
            "status": {"enum": ["ready", "degraded", "loading", "unavailable", "failing"]},
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
            # texts, and pairs [first, second] (an NLI classifier's premise and hypothesis)
            "input": {"oneOf": [parts["text"], {
                "type": "array", "minItems": 1, "maxItems": parts["texts"]["maxItems"],
                "items": {"oneOf": [parts["text"], {"type": "array", "minItems": 2,
                                                    "maxItems": 2, "items": parts["text"]}]}}]},
            "model": parts["model"]("classification"), "top_k": count,
            "user": parts["user"], "priority": parts["priority"]}},
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
            "max_tokens_per_doc": {**count, "description": "Cohere v2's: each document cut "
                                   "to its first so many of the model's tokens"},
            "user": parts["user"], "priority": parts["priority"]}},
        "RerankResponse": {"type": "object", "properties": {
            "id": {"type": "string"}, "model": {"type": "string"},
            "revision": {"type": "string"}, "usage": usage,
            "results": {"type": "array", "description": "best first", "items": {
                "type": "object", "properties": {
                    "index": {"type": "integer"}, "relevance_score": {"type": "number"},
                    "document": {"type": "object", "properties": {
                        "text": {"type": "string"}}}}}}}},
        "CohereEmbedRequest": {"type": "object", "required": ["texts"], "properties": {
            "texts": parts["texts"], "model": parts["model"]("embedding", "null"),
            "input_type": {"type": ["string", "null"], "enum": [
                "search_query", "search_document", "classification", "clustering", None],
                "description": "the model's prompt of that purpose, if it has one"},
            "embedding_types": {"type": ["array", "null"], "minItems": 1, "items": {
                "enum": ["float", "int8", "uint8", "binary", "ubinary", "base64"]}},
            "truncate": {"type": ["string", "null"], "enum": ["NONE", "START", "END", None]},
            "output_dimension": {"type": ["integer", "null"], "minimum": 1},
            "priority": {"type": ["integer", "null"], "minimum": 0, "maximum": 10,
                         "description": "Cohere's: 0 (the default) is the highest"},
            "user": parts["user"]}},
        "CohereEmbedResponse": {"type": "object", "properties": {
            "id": {"type": "string"}, "texts": {"type": "array", "items": {"type": "string"}},
            "response_type": {"enum": ["embeddings_floats", "embeddings_by_type"]},
            "embeddings": {"oneOf": [
                {"type": "array", "items": ref("Vector")},
                {"type": "object", "additionalProperties": {"type": "array", "items": {}}}]},
            "meta": {"type": "object"}, "model": {"type": "string"},
            "revision": {"type": "string"}}},
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
    sequence = {"type": "array", "items": parts["text"], "minItems": 1, "maxItems": 2}
    # A pattern, not an enum of both cases: openapi-python-client names enum values in upper
    # case, and "Right" and "right" collided (its generation failed, an outside check)
    direction = {"type": ["string", "null"], "pattern": "^([Rr]ight|[Ll]eft)$",
                 "description": "Right (the default) or Left, or the same in lower case"}
    scheduling = {"priority": parts["priority"], "user": parts["user"]}
    return {
        "Info": {"type": "object", "properties": {
            "model_id": {"type": "string"}, "model_sha": {"type": ["string", "null"]},
            "model_dtype": {"type": "string"}, "model_type": {"type": "object"},
            "max_concurrent_requests": {"type": "integer"},
            "max_input_length": {"type": "integer"}, "max_batch_tokens": {"type": "integer"},
            "max_batch_requests": {"type": ["integer", "null"]},
            "max_client_batch_size": {"type": "integer"}, "auto_truncate": {"type": "boolean"},
            "tokenization_workers": {"type": "integer"}, "version": {"type": "string"},
            "sha": {"type": ["string", "null"]}, "docker_label": {"type": ["string", "null"]},
            # shmserve's own, besides TEI's
            "models": {"type": "array", "items": {"type": "object"}},
            "devices": {"type": "array", "items": {"type": "object"}},
            "limits": {"type": "object"}, "frontends": {"type": "integer"},
            "workers": {"type": "integer"}}},
        "TeiEmbedRequest": {"type": "object", "required": ["inputs"], "properties": {
            **scheduling,
            "inputs": parts["inputs"], "model": parts["model"]("embedding", "null"),
            "normalize": nullable_bool,
            "truncate": nullable_bool, "truncation_direction": direction,
            "dimensions": {"type": ["integer", "null"], "minimum": 1},
            "prompt_name": parts["prompt_name"]}},
        "TeiEmbedAllRequest": {"type": "object", "required": ["inputs"], "properties": {
            **scheduling,
            "inputs": parts["inputs"], "model": parts["model"]("embedding", "null"),
            "truncate": nullable_bool, "truncation_direction": direction,
            "prompt_name": parts["prompt_name"]}},
        "TeiEmbedSparseRequest": {"type": "object", "required": ["inputs"], "properties": {
            **scheduling,
            "inputs": parts["inputs"], "model": parts["model"]("sparse"),
            "truncate": nullable_bool, "truncation_direction": direction,
            "prompt_name": parts["prompt_name"]}},
        "SparseValue": {"type": "object", "required": ["index", "value"], "properties": {
            "index": {"type": "integer", "minimum": 0,
                      "description": "a vocabulary index (a token id)"},
            "value": {"type": "number", "exclusiveMinimum": 0}}},
        "TeiSimilarityRequest": {"type": "object", "required": ["inputs"], "properties": {
            **scheduling,
            "inputs": {"type": "object", "required": ["source_sentence", "sentences"],
                       "properties": {"source_sentence": parts["text"],
                                      "sentences": parts["texts"]}},
            "model": parts["model"]("embedding", "null"),
            "truncate": nullable_bool, "truncation_direction": direction,
            "prompt_name": parts["prompt_name"]}},
        "HubClassifyRequest": {"type": "object", "required": ["inputs", "parameters"],
                               "properties": {
            **scheduling,
            "inputs": {"oneOf": [parts["text"], parts["texts"]]},
            "parameters": {"type": ["object", "null"], "properties": {
                "top_k": {"type": ["integer", "null"], "minimum": 1},
                "function_to_apply": {"enum": ["softmax", "sigmoid", "none", None]}}},
            "model": parts["model"]("classification")}},
        "TeiPredictRequest": {"type": "object", "required": ["inputs"], "properties": {
            **scheduling,
            "inputs": {"oneOf": [parts["text"], sequence, {
                "type": "array", "items": sequence, "minItems": 1,
                "maxItems": parts["texts"]["maxItems"]}],
                "description": "one input (a text, or [first, second]: a pair, read as one "
                               "sequence of two segments), or a batch of [text] and [first, "
                               "second] lists"},
            "model": parts["model"]("classification"), "raw_scores": nullable_bool,
            "truncate": nullable_bool, "truncation_direction": direction}},
        "Prediction": {"type": "object", "properties": {"score": {"type": "number"},
                                                        "label": {"type": "string"}}},
        "TeiRerankRequest": {"type": "object", "required": ["query", "texts"], "properties": {
            **scheduling,
            "query": parts["text"], "texts": parts["texts"], "model": parts["model"]("rerank"),
            "raw_scores": nullable_bool, "return_text": nullable_bool,
            "truncate": nullable_bool, "truncation_direction": direction}},
        "Rank": {"type": "object", "properties": {"index": {"type": "integer"},
                                                  "score": {"type": "number"},
                                                  "text": {"type": "string"}}},
        "TeiTokenizeRequest": {"type": "object", "required": ["inputs"], "properties": {
            "inputs": {"oneOf": [parts["text"], parts["texts"]]},
            "model": parts["model"]("embedding", "null", "classification", "rerank"),
            "add_special_tokens": nullable_bool, "prompt_name": parts["prompt_name"]}},
        "TeiDecodeRequest": {"type": "object", "required": ["ids"], "properties": {
            "ids": {"oneOf": [{"type": "array", "minItems": 1,
                               "items": {"type": "integer", "minimum": 0}},
                              {"type": "array", "minItems": 1, "items": {
                                  "type": "array", "minItems": 1,
                                  "items": {"type": "integer", "minimum": 0}}}],
                    "description": "token ids, each in [0, vocab size)"},
            "model": parts["model"]("embedding", "null", "classification", "rerank"),
            "skip_special_tokens": nullable_bool}},
        "SimpleToken": {"type": "object", "properties": {
            "id": {"type": "integer"}, "text": {"type": "string"}, "special": {"type": "boolean"},
            "start": {"type": ["integer", "null"]}, "stop": {"type": ["integer", "null"]}}},
    }


def _kserve_schemas() -> dict[str, Any]:
    tensor_meta = {"type": "object", "properties": {
        "name": {"type": "string"}, "datatype": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}}}}
    tensor = {"type": "object", "required": ["name", "datatype", "shape"], "properties": {
        "name": {"type": "string", "minLength": 1},
        "datatype": {"type": "string", "example": "BYTES"},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "parameters": {"type": "object", "properties": {
            "binary_data_size": {"type": "integer", "minimum": 0}}},
        "data": {"type": "array", "items": {}, "description": "row-major, flat or nested"}}}
    duration = {"type": "object", "properties": {"count": {"type": "integer"},
                                                 "ns": {"type": "integer"}}}
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
        "RepositoryModel": {"type": "object", "required": ["name", "version", "state"],
                            "properties": {
                                "name": {"type": "string"}, "version": {"type": "string"},
                                "state": {"enum": ["READY", "LOADING", "UNAVAILABLE"]},
                                "reason": {"type": "string"}}},
        "ModelStatistics": {"type": "object", "required": ["model_stats"], "properties": {
            "model_stats": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "version": {"type": "string"},
                "last_inference": {"type": "integer",
                                   "description": "ms since the epoch; 0: none yet"},
                "inference_count": {"type": "integer"}, "execution_count": {"type": "integer"},
                "inference_stats": {"type": "object", "additionalProperties": duration},
                "batch_stats": {"type": "array", "items": {"type": "object", "properties": {
                    "batch_size": {"type": "integer"}, "compute_infer": duration}}}}}}}},
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
