"""Infinity's routes (michaelfeil/infinity), at its paths without a prefix, so its clients
(infinity_client, LiteLLM's and LangChain's infinity providers, an OpenAI client whose base URL
is the server's root, as infinity's own docs write it) work unchanged:

    POST /embeddings  OpenAI's embeddings: POST /v1/embeddings (frontend.routes), but for
                      infinity's `dimensions` 0 (the model's width) and `modality` (text)
    POST /rerank      {"query", "documents": [str], "top_n"?, "return_documents"?,
                       "raw_scores"?, "model"?}
        -> {"object": "rerank", "results": [{"relevance_score", "index", "document"}],
            "model", "usage", "id", "created"}, best first; "document" is null unless asked
           (a body with "texts" is TEI's /rerank: frontend.tei sends only "documents" here)
    GET  /models      OpenAI's model list (GET /v1/models, without "owned_by": infinity_client
                      takes only "infinity" there) with each one's "capabilities"
                      (embed, rerank, classify) and "stats" (ready workers, queued texts)
    POST /classify    {"input": [str], "model"?, "raw_scores"?}
        -> {"object": "classify", "data": [[{"score", "label"}]], "model", "usage", "id",
            "created"}: every label of each input, best first

raw_scores gives the logits (a reranker's before its activation, a classifier's before the
softmax), as infinity's. Every body may also carry "priority" and "user", as elsewhere.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from aiohttp import web

from frontend import codec, routes, schemas, scores, tasks
from frontend.app import CONFIG, MODELS, POOL, REQUEST_ID
from frontend.errors import ApiError


def add_routes(app: web.Application) -> None:
    app.router.add_post("/embeddings", embeddings)
    app.router.add_post("/classify", classify)
    app.router.add_get("/models", list_models)


CAPABILITIES = {"embedding": ["embed"], "null": ["embed"], "rerank": ["rerank"],
                "classification": ["classify"]}


async def list_models(request: web.Request) -> web.Response:
    """infinity's model list: OpenAI's (GET /v1/models) with each model's capabilities and
    `stats`: the workers serving it now, and the texts queued on them (their last heartbeats)."""
    pool = request.app[POOL]
    data = []
    for model in request.app[MODELS].by_name.values():
        ready = {link.index: link for v in model.variants for link in pool.ready_links(v.unit)}
        entry = routes.model_object(model)
        del entry["owned_by"]  # infinity_client reads only its own name there ("infinity")
        data.append({**entry, "backend": "torch",
                     "capabilities": CAPABILITIES.get(model.spec.task, []),
                     "stats": {"ready_workers": len(ready), "queued_texts": sum(
                         link.beat.queued_texts for link in ready.values())}})
    return codec.render(request, {"object": "list", "data": data})


async def embeddings(request: web.Request) -> web.Response:
    """OpenAI's embeddings, with infinity's two additions to the body: `dimensions` 0 is the
    model's width (infinity_client sends 0 unless told), and `modality` must be text."""
    body = await codec.read_body(request)
    if isinstance(body, dict):
        modality = body.pop("modality", None)
        if modality not in (None, "text"):
            raise ApiError("invalid_request", f"'modality' {str(modality)[:40]!r} is not "
                           "served: this server embeds text", param="modality")
        if body.get("dimensions") == 0 and not isinstance(body["dimensions"], bool):
            del body["dimensions"]
    return await routes.openai_embeddings(request, body)


async def rerank(request: web.Request, body: dict) -> web.Response:
    """POST /rerank with "documents" (frontend.tei.rerank hands it here)."""
    limits = request.app[CONFIG].limits
    query = schemas.query(body, limits)
    documents = schemas.texts(scores.document_texts(schemas.required(body, "documents")),
                              "documents", limits)
    top_n = schemas.count(body, "top_n")
    back = schemas.flag(body, "return_documents", False)
    raw_scores = schemas.flag(body, "raw_scores", False)
    out = await tasks.rerank(request, schemas.model_name(body), query, documents,
                             priority=schemas.body_priority(body), user=schemas.user(body))
    values = out.logits if raw_scores else out.scores
    results = [{"relevance_score": float(values[i]), "index": i,
                "document": documents[i] if back else None}
               for i in out.order()[:top_n].tolist()]
    return _answer(request, "rerank", "results", results, out.ran)


async def classify(request: web.Request) -> web.Response:
    body = schemas.mapping(await codec.read_body(request))
    texts = scores.classify_inputs(schemas.required(body, "input"), request.app[CONFIG].limits)
    raw_scores = schemas.flag(body, "raw_scores", False)
    out = await tasks.classify(request, schemas.model_name(body), texts, param="input",
                               priority=schemas.body_priority(body), user=schemas.user(body))
    rows = out.logits if raw_scores else out.probs
    data = [[{"score": float(row[i]), "label": out.labels[i]}
             for i in np.argsort(-row, kind="stable").tolist()] for row in rows]
    return _answer(request, "classify", "data", data, out.ran)


def _answer(request: web.Request, kind: str, key: str, items: list[Any],
            ran: tasks.Ran) -> web.Response:
    return codec.render(request, {
        "object": kind, key: items, "model": ran.model.spec.name,
        "usage": {"prompt_tokens": ran.enc.tokens, "total_tokens": ran.enc.tokens},
        "id": request[REQUEST_ID], "created": int(time.time())},
        headers=tasks.stage_headers(request, ran.outcome))
