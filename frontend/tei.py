"""Hugging Face text-embeddings-inference (TEI) routes, in TEI's request and response shapes.

    POST /embed     {"inputs": str | [str] | [int] | [[int]], "normalize", "truncate",
                     "truncation_direction", "dimensions", "prompt_name"} -> [[float]]
    POST /embed_all {"inputs": str | [str] | [int] | [[int]], "truncate",
                     "truncation_direction", "prompt_name"} -> [[[float]]]  (every token's
                     last hidden state, special and prompt tokens included, not pooled or
                     normalised; one list of rows per input)
    POST /embed_sparse {"inputs": str | [str] | [int] | [[int]], "truncate",
                     "truncation_direction"} -> [[{"index", "value"}]]  (a sparse model's
                     SPLADE vector per input: its non-zero values by vocabulary index, in
                     index order)
    POST /rerank    {"query", "texts", "raw_scores", "return_text", ...} -> [{"index", "score"}]
    POST /tokenize  {"inputs": str | [str], "add_special_tokens", "prompt_name"} -> [[{"id",
                     "text", "special", "start", "stop"}]]   (start/stop: byte offsets into the
                     text after its prompt, as TEI's)
    POST /decode    {"ids": [int] | [[int]], "skip_special_tokens": true} -> [str]  (one text
                     per list of ids, by the model's tokenizer; both in frontend/tei_tokens.py)
    POST /similarity {"inputs": {"source_sentence": str, "sentences": [str]}} -> [float]
                     (cosine of each sentence's vector to the source's)
    POST /          TEI's route for its model's task, which huggingface_hub's InferenceClient
                     posts to: a similarity body as /similarity; the Inference API's
                     text-classification body {"inputs": str | [str], "parameters": {"top_k",
                     "function_to_apply": softmax | sigmoid | none}} -> [[{"label", "score"}]]
                     (one list per input, best first, as the client reads it) on a
                     classification model; a rerank body ({"query", "texts"}) as /rerank; any
                     other as /embed.
    POST /predict   on a classification model, TEI's {"inputs": str | [str, str] | [[str] |
                     [str, str], ...], "raw_scores", "truncate", "truncation_direction"} ->
                     [{"score", "label"}] for one input, [[...]] for a batch: every label,
                     best first; a pair ([first, second]: an NLI model's premise and
                     hypothesis) is read as one sequence of two segments; raw_scores: the
                     logits, not their softmax. A body with `texts` is this server's own
                     /predict (frontend.routes.predict).

TEI's ``GET /info`` is served with the observability routes. Differences from TEI, on purpose:
errors keep this server's body (OpenAI's shape, see frontend.errors), not TEI's
``{"error", "error_type"}``; a body may name a "model" (TEI serves one); /rerank
needs a cross-encoder (task rerank) and answers 422 `unsupported_task` for other models.
In msgpack responses (Accept), /embed vectors and /embed_all's token rows are raw
little-endian float32 bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from aiohttp import web

from frontend import codec, infinity, routes, scores, tasks, tei_tokens, vectors
from frontend.app import CONFIG, MODELS
from frontend.errors import ApiError
from frontend.schemas import (EmbedRequest, body_priority, check_count, check_text, count,
                              dimensions, flag, mapping, model_name, one_or_many, prompt_name,
                              query, required, texts, texts_or_ids, user)
from shmserve.config import LimitsConfig

DIRECTIONS = {"right": "right", "Right": "right", "left": "left", "Left": "left"}


def add_routes(app: web.Application) -> None:
    app.router.add_post("/", root)
    app.router.add_post("/predict", predict)
    app.router.add_post("/embed", embed)
    app.router.add_post("/embed_all", embed_all)
    app.router.add_post("/embed_sparse", embed_sparse)
    app.router.add_post("/similarity", similarity)
    app.router.add_post("/rerank", rerank)
    app.router.add_post("/tokenize", tei_tokens.tokenize)
    app.router.add_post("/decode", tei_tokens.decode)


async def root(request: web.Request) -> web.Response:
    body = mapping(await codec.read_body(request))
    if isinstance(body.get("inputs"), dict):
        return await _similarity(request, body)
    if "parameters" in body:  # the Inference API's envelope: text-classification's here
        return await _classify(request, body)
    if "query" in body and "texts" in body:  # TEI's rerank body, as TEI's / takes it
        return await _rerank(request, body)
    return await _embed(request, body)


async def predict(request: web.Request) -> web.Response:
    body = await codec.read_body(request)
    if not isinstance(body, dict) or "inputs" not in body:
        return await routes.predict(request, body)  # this server's own shape
    if "texts" in body:
        raise ApiError("invalid_request", "send 'texts' (this server's /predict) or 'inputs' "
                       "(TEI's, for a classification model), not both", param="inputs")
    items, batch = predict_inputs(body["inputs"], request.app[CONFIG].limits)
    raw = flag(body, "raw_scores", False)
    truncate, direction = _truncation(body)
    name = model_name(body)
    out = await tasks.classify(request, name, items, param="inputs",
                               priority=body_priority(body), user=user(body),
                               truncate=truncate, direction=direction,
                               task=_predict_task(request, name))
    # TEI: a softmax over two or more labels, a sigmoid of a reranker's one logit (whatever
    # activation the cross-encoder names), the logits with raw_scores; one label is LABEL_0, as
    # /info names it.
    if raw:
        rows = out.logits
    else:
        rows = out.probs if out.logits.shape[1] > 1 else tasks.activate(out.logits, "sigmoid")
    labels = out.labels or ("LABEL_0",)
    ranked = [scores.ranked(row, labels, None) for row in rows]
    return codec.render(request, ranked if batch else ranked[0],
                        headers=tasks.stage_headers(request, out.ran.outcome))


def _predict_task(request: web.Request, name: str | None) -> str:
    """TEI's /predict serves a classifier or a reranker: the named model's task when it is a
    rerank model; unnamed, a reranker only when no classification model is served."""
    models = request.app[MODELS]
    if name is not None:
        canonical = models.canonical(name)  # None: the route's own resolve answers its 404
        rerank = canonical is not None and models.by_name[canonical].spec.task == "rerank"
        return "rerank" if rerank else "classification"
    served = {m.spec.task for m in models.by_name.values()}
    return "rerank" if "rerank" in served and "classification" not in served \
        else "classification"


def predict_inputs(value: Any, limits: LimitsConfig
                   ) -> tuple[list[str | tuple[str, str]], bool]:
    """TEI's PredictInput, read as TEI reads it: a string, or a list of strings (one: a text,
    two: a pair), is one input; a list of such lists is a batch. Returns the inputs (a pair as
    a tuple) and whether it was a batch."""
    if isinstance(value, str) or (isinstance(value, list) and value
                                  and not isinstance(value[0], list)):
        return [_sequence(value, "inputs", limits)], False
    if not isinstance(value, list) or not value:
        raise ApiError("invalid_request", "'inputs' must be a string, a pair of strings [first, "
                       "second], or a non-empty batch of [text] and [first, second] lists",
                       param="inputs")
    check_count(value, "inputs", limits, "inputs")
    return [_sequence(v, f"inputs[{i}]", limits, listed=True) for i, v in enumerate(value)], True


def _sequence(value: Any, name: str, limits: LimitsConfig, listed: bool = False
              ) -> str | tuple[str, str]:
    """One input: a string, [text] or [first, second]; `listed`: a batch's, always a list."""
    if isinstance(value, str) and not listed:
        check_text(value, f"'{name}'", "inputs", limits)
        return value
    if name == "inputs" and len(value) > 2 and all(isinstance(v, str) for v in value):
        raise ApiError("invalid_request", f"'inputs' is a list of {len(value)} strings: TEI's "
                       "/predict reads a list of strings as one input (a text, or a pair of "
                       "two); send a batch as a list of lists, [[\"text\"], [\"text\"], ...]",
                       param="inputs")
    if not isinstance(value, list) or len(value) not in (1, 2) or \
            not all(isinstance(v, str) for v in value):
        if listed:  # TEI's batch: lists only, so that ["a", "b"] stays one pair
            raise ApiError("invalid_request", f"'{name}' must be [text] or [first, second] "
                           "(strings): a batch's items are lists, [[\"text\"], [\"first\", "
                           "\"second\"], ...]", param="inputs")
        raise ApiError("invalid_request", f"'{name}' must be a string, [text] or [first, "
                       "second] (strings)", param="inputs")
    for i, text in enumerate(value):
        check_text(text, f"'{name}[{i}]'", "inputs", limits)
    return value[0] if len(value) == 1 else (value[0], value[1])


CLASSIFY_PARAMETERS = ("function_to_apply", "top_k")


async def _classify(request: web.Request, body: dict) -> web.Response:
    """huggingface_hub's `text_classification`: every label of each input, best first, cut to
    `parameters.top_k`; scored by `parameters.function_to_apply` (softmax; sigmoid; none: the
    logits; by default the model's: a sigmoid for a multi-label model, else the softmax)."""
    parameters = body["parameters"] if body["parameters"] is not None else {}
    if not isinstance(parameters, dict):
        raise ApiError("invalid_request", "'parameters' must be an object", param="parameters")
    for key, value in parameters.items():  # zero-shot's candidate_labels were ignored: the
        if key not in CLASSIFY_PARAMETERS and value is not None:  # model's labels came back
            raise ApiError("invalid_request", f"'parameters.{key}' is not a text-classification "
                           f"parameter (one of {', '.join(CLASSIFY_PARAMETERS)}); zero-shot "
                           "classification, fill-mask and the Inference API's other tasks are "
                           "not served", param="parameters")
    applied = parameters.get("function_to_apply")
    if applied not in (None, "softmax", "sigmoid", "none"):
        raise ApiError("invalid_request", f"'parameters.function_to_apply' {applied!r}: one of "
                       "'softmax', 'sigmoid' or 'none'", param="parameters")
    top_k = count(parameters, "top_k", within="parameters")
    given = one_or_many(required(body, "inputs"), "inputs", request.app[CONFIG].limits)
    out = await tasks.classify(request, model_name(body), given, param="inputs",
                               priority=body_priority(body), user=user(body))
    rows = (out.logits if applied == "none" else
            tasks.activate(out.logits, "sigmoid") if applied == "sigmoid" else
            tasks.softmax(out.logits) if applied == "softmax" else out.probs)
    return codec.render(request, [scores.ranked(row, out.labels, top_k) for row in rows],
                        headers=tasks.stage_headers(request, out.ran.outcome))


async def similarity(request: web.Request) -> web.Response:
    return await _similarity(request, mapping(await codec.read_body(request)))


async def _similarity(request: web.Request, body: dict) -> web.Response:
    inputs = required(body, "inputs")
    if not isinstance(inputs, dict):
        raise ApiError("invalid_request", "'inputs' must be an object {\"source_sentence\": str, "
                       "\"sentences\": [str]}", param="inputs")
    limits = request.app[CONFIG].limits
    for key in ("source_sentence", "sentences"):
        if key not in inputs:
            raise ApiError("invalid_request", f"'inputs.{key}' is required", param="inputs")
    source = inputs["source_sentence"]
    if not isinstance(source, str):
        raise ApiError("invalid_request", "'inputs.source_sentence' must be a string",
                       param="inputs")
    check_text(source, "'inputs.source_sentence'", "inputs", limits)
    given = [source, *texts(inputs["sentences"], "inputs.sentences", limits)]
    options = _similarity_options(body)
    truncate, direction = _truncation(options)
    parsed = EmbedRequest(given, model_name(body), priority=body_priority(body),
                          truncate=truncate, truncation_direction=direction, user=user(body),
                          prompt_name=prompt_name(options))
    _, outcome, _ = await routes.embed(request, parsed, "inputs")
    rows = vectors.normalize(outcome.vectors)
    # float32, written as its shortest decimal like every vector; a cosine of two unit rows
    # can round past 1 (1.0000001192092896 for a text against itself)
    return codec.render(request, list(np.clip(rows[1:] @ rows[0], -1.0, 1.0)),
                        headers=tasks.stage_headers(request, outcome))


# TEI's SimilarityRequest carries its options in "parameters" (SimilarityParameters); they were
# read only at the top level, so a TEI client's truncate: false and prompt_name were dropped
# without a word (an outside check). Both places are read; a key in both is refused.
SIMILARITY_PARAMETERS = ("truncate", "truncation_direction", "prompt_name")


def _similarity_options(body: dict) -> dict:
    """The similarity options of `body`: its top-level keys and those of `parameters`."""
    parameters = body.get("parameters")
    if parameters is None:
        return body
    if not isinstance(parameters, dict):
        raise ApiError("invalid_request", "'parameters' must be an object", param="parameters")
    for key in parameters:
        if key not in SIMILARITY_PARAMETERS:
            raise ApiError("invalid_request", f"'parameters.{key}' is not a similarity "
                           f"parameter (one of {', '.join(SIMILARITY_PARAMETERS)})",
                           param="parameters")
        if key in body:
            raise ApiError("invalid_request", f"'{key}' is given at the top level and in "
                           "'parameters': send it once", param="parameters")
    return {**body, **parameters}


async def embed(request: web.Request) -> web.Response:
    return await _embed(request, mapping(await codec.read_body(request)))


async def _embed(request: web.Request, body: dict) -> web.Response:
    parsed, normalize = parse_embed(body, request.app[CONFIG].limits)
    # The model that will serve: with no name, the first embedding model (not the first
    # configured one, which may be a classifier).
    model = tasks.resolve(request, parsed.model, "embedding")
    # A model that normalises its vectors gives them unnormalised when asked (TEI's default
    # is to normalise, and TEI never normalises on a checkpoint's behalf).
    model, outcome, _ = await routes.embed(request, parsed, "inputs", model,
                                           raw=not normalize and model.spec.normalize)
    rows = outcome.vectors
    if normalize and not model.spec.normalize:
        rows = vectors.normalize(rows)
    return codec.render(request, codec.vectors(rows, codec.wants_msgpack(request)),
                        headers=tasks.stage_headers(request, outcome))


async def embed_all(request: web.Request) -> web.Response:
    # /embed's body; its `normalize` and `dimensions` are for pooled vectors, not token rows
    parsed, _ = parse_embed(mapping(await codec.read_body(request)), request.app[CONFIG].limits)
    if parsed.dimensions is not None:
        raise ApiError("invalid_request", "'dimensions' shortens pooled vectors (/embed); "
                       "/embed_all gives every token's whole row", param="dimensions")
    model, outcome, enc = await routes.embed(request, parsed, "inputs", per_token=True)
    rows = codec.vectors(outcome.vectors, codec.wants_msgpack(request))
    bounds = enc.offsets.tolist()
    return codec.render(request, [rows[a:b] for a, b in zip(bounds[:-1], bounds[1:])],
                        headers=tasks.stage_headers(request, outcome))


async def embed_sparse(request: web.Request) -> web.Response:
    # /embed's body; `normalize` and `dimensions` are for dense vectors
    parsed, _ = parse_embed(mapping(await codec.read_body(request)), request.app[CONFIG].limits)
    if parsed.dimensions is not None:
        raise ApiError("invalid_request", "'dimensions' shortens dense vectors (/embed); a "
                       "sparse vector keeps its vocabulary indices", param="dimensions")
    model = tasks.resolve(request, parsed.model, "sparse")
    _, outcome, _ = await routes.embed(request, parsed, "inputs", model)
    return codec.render(request, [sparse(row) for row in bounded(outcome.vectors)],
                        headers=tasks.stage_headers(request, outcome))


# The most non-zero values one /embed_sparse answer holds: ~30 MB of JSON. A trained SPLADE
# model gives a few hundred a text (256 texts: ~80,000); a checkpoint whose vectors are not
# sparse gave 26,000 a text, and 256 texts made 297 MB of JSON and a 2.4 GB frontend.
SPARSE_VALUES = 1_000_000


def bounded(rows: np.ndarray) -> np.ndarray:
    """`rows`, unless their non-zero values are more than SPARSE_VALUES (413)."""
    values = int(np.count_nonzero(rows))
    if values > SPARSE_VALUES:
        raise ApiError("too_large", f"the answer would hold {values:,} non-zero values, over "
                       f"the {SPARSE_VALUES:,} a request may (~30 bytes of JSON each); send "
                       "fewer texts (a trained SPLADE model has a few hundred a text)",
                       param="inputs")
    return rows


def sparse(row: np.ndarray) -> list[dict[str, Any]]:
    """A SPLADE vector as TEI gives it: its non-zero values with their indices, in order; the
    values float32, which the JSON writer gives as the shortest decimal of a float32."""
    index = np.flatnonzero(row)
    return [{"index": i, "value": v} for i, v in zip(index.tolist(), row[index])]


def parse_embed(body: dict, limits: LimitsConfig) -> tuple[EmbedRequest, bool]:
    given, ids = texts_or_ids(required(body, "inputs"), "inputs", limits)
    normalize = flag(body, "normalize", True)
    truncate, direction = _truncation(body)
    return EmbedRequest(given, model_name(body), priority=body_priority(body), token_ids=ids,
                        dimensions=dimensions(body), truncate=truncate,
                        truncation_direction=direction, user=user(body),
                        prompt_name=prompt_name(body, ids is not None)), normalize


async def rerank(request: web.Request) -> web.Response:
    body = mapping(await codec.read_body(request))
    # both sent (null is not sent, as every optional field's null here): refused, not read as
    # TEI's silently (an outside check)
    texts_sent, documents_sent = (body.get(k) is not None for k in ("texts", "documents"))
    if texts_sent and documents_sent:
        raise ApiError("invalid_request", "send 'texts' (TEI's /rerank) or 'documents' "
                       "(infinity's and Cohere's), not both", param="documents")
    if documents_sent:  # infinity's (and Cohere's) body
        return await infinity.rerank(request, body)
    return await _rerank(request, body)


async def _rerank(request: web.Request, body: dict) -> web.Response:
    limits = request.app[CONFIG].limits
    asked = query(body, limits)
    documents = texts(required(body, "texts"), "texts", limits)
    raw_scores = flag(body, "raw_scores", False)
    return_text = flag(body, "return_text", False)
    truncate, direction = _truncation(body)
    out = await tasks.rerank(request, model_name(body), asked, documents, param="texts",
                             priority=body_priority(body), user=user(body), truncate=truncate,
                             direction=direction)
    # raw_scores: the logit before the cross-encoder's activation, as TEI's.
    scores = out.logits if raw_scores else out.scores
    results = [{"index": i, "score": float(scores[i]),
                **({"text": documents[i]} if return_text else {})} for i in out.order().tolist()]
    return codec.render(request, results, headers=tasks.stage_headers(request, out.ran.outcome))


def _truncation(body: dict) -> tuple[bool | None, str]:
    truncate = body.get("truncate")
    if truncate is not None and not isinstance(truncate, bool):
        raise ApiError("invalid_request", "'truncate' must be a boolean", param="truncate")
    direction = body.get("truncation_direction")
    if direction is None:
        direction = "right"
    if not isinstance(direction, str) or direction not in DIRECTIONS:
        raise ApiError("invalid_request", "'truncation_direction' must be 'Right' or 'Left'",
                       param="truncation_direction")
    return truncate, DIRECTIONS[direction]
