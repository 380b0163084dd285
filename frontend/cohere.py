"""Cohere's embed API, as its clients send it (`cohere.Client.embed`, `cohere.ClientV2.embed`):

    POST /v1/embed  {"texts": [str], "model"?, "input_type"?, "embedding_types"?, "truncate"?}
        -> {"id", "texts", "embeddings": [[float]], "meta", "response_type": "embeddings_floats"}
           (with embedding_types: {"embeddings": {TYPE: [...]}, "response_type":
           "embeddings_by_type"})
    POST /v2/embed  the same body (also "output_dimension", "priority"), always by type
                    ("float" when embedding_types is absent)

input_type picks the model's prompt of that purpose, when it has one (search_query: its
`search_query` or `query` prompt; search_document: `search_document`, `document`, `passage`;
classification, clustering: of that name); else the model's default prompt applies, as on every
route. truncate: END (default) cuts each text's end to the model's limit, START its start, NONE
refuses a text past it (413). output_dimension keeps the leading components (Matryoshka, as
`dimensions` elsewhere). Embedding types (`quantized`): float; base64 (the float32 bytes,
little-endian); int8 and uint8 (each vector scaled by its largest magnitude to 127: cosines
move by at most ~0.003 at 384 components, docs/protocols.md; raw dot products across vectors
are not comparable); binary and ubinary (one bit per component, set where it is positive,
packed eight to a byte, as int8 or uint8). Floats are written as every route writes vectors
(JSON: float32's shortest decimal; msgpack: raw little-endian float32 bytes per vector).
Images, "inputs" and "max_tokens" are refused (422); Cohere's priority (0, the default, is the
highest) is this server's priority negated.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from aiohttp import web

from frontend import codec, routes, schemas, tasks
from frontend.app import CONFIG, REQUEST_ID
from frontend.errors import ApiError
from frontend.schemas import EmbedRequest

# input_type -> the prompt names that serve it, in order of preference
PURPOSES = {
    "search_query": ("search_query", "query"),
    "search_document": ("search_document", "document", "passage"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}
TYPES = ("float", "int8", "uint8", "binary", "ubinary", "base64")
TRUNCATE = {"END": "right", "START": "left"}


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embed", embed)
    app.router.add_post("/v2/embed", embed)  # Cohere's v2; not KServe's (frontend.errors)


async def embed(request: web.Request) -> web.Response:
    body = schemas.mapping(await codec.read_body(request))
    v2 = request.path == "/v2/embed"
    for key, why in (("images", "this server embeds texts"),
                     ("inputs", "this server embeds texts: send them as 'texts'"),
                     ("max_tokens", "each text is cut to the model's input limit (truncate)")):
        if body.get(key) is not None:
            raise ApiError("invalid_request", f"'{key}' is not supported: {why}", param=key)
    texts = schemas.texts(schemas.required(body, "texts"), "texts", request.app[CONFIG].limits)
    types = _types(body.get("embedding_types"))
    truncate = body.get("truncate", "END")
    if truncate is None:
        truncate = "END"
    if truncate not in ("NONE", *TRUNCATE):
        raise ApiError("invalid_request", "'truncate' must be 'NONE', 'START' or 'END'",
                       param="truncate")
    dimension = schemas.whole(body.get("output_dimension"))
    if dimension is not None and (not schemas.is_int(dimension) or dimension < 1):
        raise ApiError("invalid_request", "'output_dimension' must be a positive integer",
                       param="output_dimension")
    model = tasks.resolve(request, schemas.model_name(body), "embedding")
    if dimension is not None and dimension > model.spec.dim:  # named as this route names it
        raise ApiError("invalid_request", f"'output_dimension' is {dimension}; this model's "
                       f"vectors have {model.spec.dim}", param="output_dimension")
    parsed = EmbedRequest(texts, model.spec.name, priority=_priority(body),
                          dimensions=dimension, truncate=truncate != "NONE",
                          truncation_direction=TRUNCATE.get(truncate, "right"),
                          user=schemas.user(body),
                          prompt_name=_prompt(body.get("input_type"), model.spec.prompts))
    try:
        model, outcome, enc = await routes.embed(request, parsed, "texts", model)
    except ApiError as exc:
        named = _in_cohere_terms(exc)
        if named is exc:
            raise
        raise named from None
    as_msgpack = codec.wants_msgpack(request)
    answer: dict[str, Any] = {"id": request[REQUEST_ID], "texts": texts}
    if v2 or types is not None:
        answer["embeddings"] = {t: quantized(outcome.vectors, t, as_msgpack)
                                for t in types or ["float"]}
        answer["response_type"] = "embeddings_by_type"
    else:
        answer["embeddings"] = quantized(outcome.vectors, "float", as_msgpack)
        answer["response_type"] = "embeddings_floats"
    answer["meta"] = {"api_version": {"version": "2" if v2 else "1"},
                      "billed_units": {"input_tokens": enc.tokens}}
    answer["model"], answer["revision"] = model.spec.name, outcome.revision
    return codec.render(request, answer, headers=tasks.stage_headers(request, outcome))


# The tokenizer's errors name TEI's truncation fields, the other routes' way to have a text cut;
# Cohere's truncate is both of them, with values of its own (a left cut that would lose a
# prompt's tokens named truncation_direction here: an outside check).
COHERE_TERMS = (("send truncate: true", "send truncate: END"),  # (START: not with every model)
                ("truncation_direction right", "truncate END"))


def _in_cohere_terms(exc: ApiError) -> ApiError:
    """`exc` naming Cohere's truncate where it names TEI's fields; `exc` itself otherwise."""
    message = exc.message
    for tei, cohere in COHERE_TERMS:
        message = message.replace(tei, cohere)
    if message == exc.message:
        return exc
    param = "truncate" if exc.param == "truncation_direction" else exc.param
    return ApiError(exc.kind, message, param=param)


def quantized(rows: np.ndarray, kind: str, as_msgpack: bool = False) -> list:
    """float32 rows [n, dim] as Cohere's embedding type `kind` gives them (module docstring)."""
    if kind == "float":
        return codec.vectors(rows, as_msgpack)
    if kind == "base64":
        return [base64.b64encode(np.ascontiguousarray(r, "<f4").tobytes()).decode("ascii")
                for r in rows]
    if kind in ("int8", "uint8"):
        scale = np.abs(rows).max(axis=1, keepdims=True)
        signed = np.rint(rows / np.where(scale > 0, scale, 1) * 127).astype(np.int16)
        return (signed + 128 if kind == "uint8" else signed).tolist()
    packed = np.packbits(rows > 0, axis=1)  # uint8, the first component in the highest bit
    return (packed.astype(np.int16) - 128 if kind == "binary" else packed).tolist()


def _types(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(v in TYPES for v in value):
        raise ApiError("invalid_request", "'embedding_types' must be a non-empty list of "
                       f"{', '.join(TYPES)}", param="embedding_types")
    return list(dict.fromkeys(value))


def _prompt(input_type: Any, prompts: tuple[tuple[str, str], ...]) -> str | None:
    if input_type is None:
        return None
    if not isinstance(input_type, str) or input_type not in PURPOSES:
        # (a list or an object is unhashable: its lookup raised, a 500: an outside check)
        raise ApiError("invalid_request", "'input_type' must be one of "
                       f"{', '.join(PURPOSES)} (images are not served)", param="input_type")
    return next((name for name in PURPOSES[input_type] if name in dict(prompts)), None)


def _priority(body: dict) -> int | None:
    """Cohere's priority: 0 (the default) is the highest, larger is lower."""
    value = schemas.whole(body.get("priority"))
    if value is None:
        return None
    if not schemas.is_int(value) or not 0 <= value <= 10:
        raise ApiError("invalid_request", "'priority' must be an integer from 0 (the highest, "
                       "the default) to 10", param="priority")
    return -value
