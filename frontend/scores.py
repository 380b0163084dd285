"""HTTP routes of the scoring tasks, in the shapes clients already send:

    POST /v1/classify  {"input": str | [str], "model"?, "top_k"?}
        -> {"object": "list", "model", "revision", "data": [{"object": "classification",
            "index", "label", "probs", "num_classes", "labels": [{"label", "score"}]}], "usage"}
           (vLLM's classify shape; `labels` is sorted by score and cut to top_k)
    POST /predict      {"texts": str | [str], "model"?, "top_k"?} on a classification model
        -> {"results": [[{"label", "score"}]], "model", "revision", "usage"}
    POST /v1/rerank    {"query", "documents": [str | {"text"}], "model"?, "top_n"?,
                        "return_documents"?}
        -> {"id", "model", "revision", "results": [{"index", "relevance_score",
            "document"?: {"text"}}], "usage"}   (Cohere's and Jina's shape, best first)
    POST /v2/rerank    the same, as Cohere's v2 client sends it; its answer adds Cohere's
                       "meta" (one search unit); "max_tokens_per_doc" (v2) cuts each document
                       to so many tokens; "max_chunks_per_doc" and "rank_fields" other than
                       ["text"] (v1) are refused (422; 400 here, as Cohere answers:
                       frontend.errors.status_on)

Every body may also carry "priority" and "user" (an A/B sticky key, see models.sticky_key).
The running itself is frontend.tasks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from aiohttp import web

from frontend import codec, schemas, tasks
from frontend.app import CONFIG, REQUEST_ID
from frontend.errors import ApiError
from frontend.tasks import stage_headers


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/classify", classify)
    app.router.add_post("/v1/rerank", rerank)
    app.router.add_post("/v2/rerank", rerank)  # Cohere's v2; not KServe's (frontend.app)


async def classify(request: web.Request) -> web.Response:
    body = schemas.mapping(await codec.read_body(request))
    texts = classify_inputs(schemas.required(body, "input"), request.app[CONFIG].limits)
    top_k = schemas.count(body, "top_k")
    out = await tasks.classify(request, schemas.model_name(body), texts, param="input",
                               priority=schemas.body_priority(body), user=schemas.user(body))
    data = [{"object": "classification", "index": i, "label": out.labels[int(np.argmax(row))],
             "probs": row.tolist(), "num_classes": len(out.labels),
             "labels": ranked(row, out.labels, top_k)} for i, row in enumerate(out.probs)]
    ran = out.ran
    return codec.render(request, {
        "object": "list", "model": ran.model.spec.name, "revision": ran.outcome.revision,
        "data": data, "usage": _usage(ran.enc.tokens)},
        headers=stage_headers(request, ran.outcome))


def classify_inputs(value: Any, limits) -> list[str | tuple[str, str]]:
    """/v1/classify's `input`: a string, a list of strings, or a list whose items are strings
    and pairs [first, second] (a zero-shot NLI classifier's premise and hypothesis, run as a
    pair as the model was trained: an outside check found pairs refused here, and only TEI's
    /predict taking them)."""
    if not isinstance(value, list) or not value:
        return schemas.one_or_many(value, "input", limits)  # its message for those
    schemas.check_count(value, "input", limits, "inputs")
    items: list[str | tuple[str, str]] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            schemas.check_text(item, f"'input[{i}]'", "input", limits)
            items.append(item)
            continue
        if not (isinstance(item, list) and len(item) == 2
                and all(isinstance(t, str) for t in item)):
            raise ApiError("invalid_request", f"'input[{i}]' must be a string or a pair "
                           "[first, second] of strings", param="input")
        for j, text in enumerate(item):
            schemas.check_text(text, f"'input[{i}][{j}]'", "input", limits)
        items.append((item[0], item[1]))
    return items


async def predict(request: web.Request, body: dict, parsed: schemas.EmbedRequest
                  ) -> web.Response:
    """/predict on a classification model: label lists, best first."""
    top_k = schemas.count(body, "top_k")
    out = await tasks.classify(request, parsed.model, parsed.texts, param="texts",
                               priority=parsed.priority, user=parsed.user)
    ran = out.ran
    return codec.render(request, {
        "results": [ranked(row, out.labels, top_k) for row in out.probs],
        "model": ran.model.spec.name, "revision": ran.outcome.revision,
        "usage": _usage(ran.enc.tokens)}, headers=stage_headers(request, ran.outcome))


async def rerank(request: web.Request) -> web.Response:
    body = schemas.mapping(await codec.read_body(request))
    limits = request.app[CONFIG].limits
    query = schemas.query(body, limits)
    documents = schemas.texts(document_texts(schemas.required(body, "documents")),
                              "documents", limits)
    top_n = schemas.count(body, "top_n")
    back = schemas.flag(body, "return_documents", False)
    # Cohere v2's: each document cut to so many of the model's tokens before its pair is
    # (refused before: cohere-haystack's CohereRanker sends 4096 by default, an outside check)
    doc_tokens = schemas.count(body, "max_tokens_per_doc")
    if body.get("max_chunks_per_doc") is not None:  # Cohere v1's
        raise ApiError("invalid_request", "'max_chunks_per_doc' is not supported: each query "
                       "and document pair is cut to the model's limit (limits.truncate)",
                       param="max_chunks_per_doc")
    if body.get("rank_fields") not in (None, ["text"]):  # Cohere v1's, for object documents
        raise ApiError("invalid_request", "'rank_fields' is not supported: documents are "
                       "ranked by their text (a string, or an object's 'text')",
                       param="rank_fields")
    out = await tasks.rerank(request, schemas.model_name(body), query, documents,
                             priority=schemas.body_priority(body), user=schemas.user(body),
                             doc_tokens=doc_tokens)
    order = out.order()[:top_n]
    results = []
    for i in order.tolist():
        result: dict[str, Any] = {"index": i, "relevance_score": float(out.scores[i])}
        if back:
            result["document"] = {"text": documents[i]}
        results.append(result)
    ran = out.ran
    answer = {"id": request[REQUEST_ID], "model": ran.model.spec.name,
              "revision": ran.outcome.revision, "results": results,
              "usage": _usage(ran.enc.tokens)}
    if request.path == "/v2/rerank":
        answer["meta"] = {"api_version": {"version": "2"},
                          "billed_units": {"search_units": 1}}
    return codec.render(request, answer, headers=stage_headers(request, ran.outcome))


def ranked(probs: np.ndarray, labels: tuple[str, ...], top_k: int | None
           ) -> list[dict[str, Any]]:
    order = np.argsort(-probs, kind="stable")[:top_k]
    return [{"label": labels[i], "score": float(probs[i])} for i in order.tolist()]


def document_texts(value: Any) -> Any:
    """Documents as strings; {"text": str} objects (as Cohere and Jina accept) are unwrapped."""
    if not isinstance(value, list):
        raise ApiError("invalid_request", "'documents' must be a list of strings or "
                       "{\"text\"} objects", param="documents")
    for i, v in enumerate(value):
        if not (isinstance(v, str) or isinstance(v, dict) and isinstance(v.get("text"), str)):
            raise ApiError("invalid_request", f"'documents[{i}]' must be a string or an object "
                           "with a string 'text'", param="documents")
    return [v["text"] if isinstance(v, dict) else v for v in value]


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens}
