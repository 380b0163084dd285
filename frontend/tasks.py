"""Running a request through a model, whatever its task: the one pipeline every inference route
shares, and the entry points of the scoring tasks for any route (TEI /rerank, KServe tensors):

    resolve(request, name, task)                      -> ServedModel, or a 404/422 ApiError
    run(request, model, encode, chars)                -> Ran: float32 rows [n, width] + metadata
    classify(request, name, texts)                    -> Classified: logits and probabilities
                                                         [n, labels]; texts or pairs
    rerank(request, name, query, documents)           -> Reranked: logits and scores [n],
                                                         input order

Each takes the aiohttp request: the deadline (X-Request-Timeout), priority (X-Priority, or the
body's, passed in) and A/B sticky key come from it, a client that goes away cancels the work,
and the access log line and metrics get the model, the revision that served and the timings.
The caller renders the response; `stage_headers` gives the standard headers.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from aiohttp import web

from frontend import codec, metrics
from frontend.app import (ARM, CACHE, CACHED, CHARS, CHOSEN, CONFIG, DISPATCHER, HEAP, INDEX,
                          INFLIGHT, INPUTS, LOG_FIELDS, MODEL_NAME, MODELS, PINNED, POOL,
                          REPLIED_AT, REQUEST_ID, REVISION, SPLITS, STAGES, TOKENIZE_AT,
                          TOKENIZE_MS, VARIANT, ServedModel)
from frontend.dispatch import Outcome
from frontend.errors import ApiError
from frontend.chunked import abandonable
from frontend.request_headers import deadline_of, request_priority, sticky_key
from frontend.tokenizer import Encoded, TextEncoder
from frontend.variants import Variant
from frontend.variants import revision as variant_revision
from shmserve.protocol import PRIORITY_RANGE

# Tokenize off the event loop when a request is this large (characters); small ones are faster
# inline than a thread hop.
THREAD_TOKENIZE_CHARS = 4096


@dataclass(frozen=True, slots=True)
class Ran:
    model: ServedModel
    variant: Variant  # the A/B variant that served ("" name without a split)
    outcome: Outcome  # .vectors float32 [n, width]; .revision that computed every row
    enc: Encoded


@dataclass(frozen=True, slots=True)
class Classified:
    logits: np.ndarray  # float32 [n, num_labels], as the worker gave them
    probs: np.ndarray  # float32 [n, num_labels]: their softmax (a multi-label model's: sigmoid)
    labels: tuple[str, ...]  # label names by class index, from the model's config.json
    ran: Ran


@dataclass(frozen=True, slots=True)
class Reranked:
    logits: np.ndarray  # float32 [n], one per document in input order, as the worker gave them
    scores: np.ndarray  # float32 [n]: the logits through the model's activation (sigmoid or
    # identity), as sentence-transformers' CrossEncoder.predict gives them
    ran: Ran

    def order(self) -> np.ndarray:
        """Document indices, best first: by logit, which a saturated sigmoid (1.0 in float32
        past a logit of ~17) cannot tell apart; ties keep input order."""
        return np.argsort(-self.logits, kind="stable")


# The most values a JSON answer of every token's row (/embed_all) may hold: ~45 MB of JSON.
# The bound of shared memory (a quarter of a frontend's arena) let one request's answer reach
# 190 MB of JSON, a frontend's memory 580 MB and its event loop stall 1.5 s while it was written
# (an outside check); msgpack (raw float32, 4 bytes a value) keeps that bound.
JSON_TOKEN_VALUES = 1 << 22


def json_bound(request: web.Request, tokens: int, dim: int) -> None:
    if tokens * dim > JSON_TOKEN_VALUES and not codec.wants_msgpack(request):
        raise ApiError("too_large", f"{tokens:,} tokens x {dim} floats is {tokens * dim:,} "
                       f"values, over the {JSON_TOKEN_VALUES:,} a JSON answer may hold (at most "
                       f"{JSON_TOKEN_VALUES // dim:,} tokens); ask for msgpack (Accept: "
                       "application/msgpack), or send fewer or shorter texts", param="inputs")


def resolve(request: web.Request, name: str | None, task: str) -> ServedModel:
    """The named model, or the first configured model of `task`; it must be of `task`."""
    models = request.app[MODELS]
    if name is None:
        served = next((m for m in models.by_name.values() if serves(m, task)), None)
        if served is None:
            raise ApiError("not_found", f"no {task} model is served; see GET /v1/models",
                           param="model", code="model_not_found")
    else:
        served = models.resolve(name)
    request[MODEL_NAME] = served.spec.name
    if not serves(served, task):
        hint = " (sparse models: POST /embed_sparse)" if served.spec.task == "sparse" else ""
        raise ApiError("invalid_request", f"model {served.spec.name!r} is "
                       f"{_a(served.spec.task)} model; this route needs {_a(task)} model{hint}",
                       param="model", code="unsupported_task")
    return served


def serves(model: ServedModel, task: str) -> bool:
    # The null model (zeros, no compute) stands in for an embedding model in pipeline benchmarks.
    return model.spec.task == task or (task == "embedding" and model.spec.task == "null")


def _a(task: str) -> str:
    return f"an {task}" if task[0] in "aeiou" else f"a {task}"


async def classify(request: web.Request, name: str | None, texts: list[str | tuple[str, str]],
                   *, param: str = "input", priority: int | None = None,
                   user: str | None = None, truncate: bool | None = None,
                   direction: str = "right", task: str = "classification") -> Classified:
    """`texts` may hold (first, second) pairs, which the model reads as one sequence of two
    segments (an NLI model's premise and hypothesis). `task` rerank: a cross-encoder's one
    logit a text or pair (TEI's /predict on a reranker); its probs are a softmax of one, 1.0."""
    served = resolve(request, name, task)
    ran = await run(request, served,
                    lambda enc: enc.encode_mixed(texts, param, truncate, direction),
                    sum(len(t) if isinstance(t, str) else len(t[0]) + len(t[1]) for t in texts),
                    texts=len(texts), priority=priority, user=user)
    logits = ran.outcome.vectors
    spec = ran.variant.spec
    # a classifier's activation: softmax, or a multi-label one's sigmoid (a cross-encoder's,
    # read through TEI's /predict, is a softmax of one logit, 1.0)
    multi = spec.task == "classification" and spec.activation == "sigmoid"
    return Classified(logits, activate(logits, "sigmoid") if multi else softmax(logits),
                      spec.labels, ran)


async def rerank(request: web.Request, name: str | None, query: str, documents: list[str], *,
                 param: str = "documents", priority: int | None = None,
                 user: str | None = None, truncate: bool | None = None,
                 direction: str = "right", doc_tokens: int | None = None) -> Reranked:
    served = resolve(request, name, "rerank")
    ran = await run(request, served,
                    lambda enc: enc.encode_pairs(query, documents, param, truncate, direction,
                                                 doc_tokens),
                    len(query) * len(documents) + sum(map(len, documents)),
                    texts=1, priority=priority, user=user)  # one query's candidates: never bulk
    logits = np.ascontiguousarray(ran.outcome.vectors[:, 0])
    return Reranked(logits, activate(logits, ran.variant.spec.activation), ran)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Each row's softmax, in float64 from the row's largest logit (no overflow), as float32."""
    x = logits.astype(np.float64)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


def activate(logits: np.ndarray, activation: str) -> np.ndarray:
    """A cross-encoder's scores from its logits (shmserve.models.ACTIVATIONS), float32."""
    if activation == "identity":
        return logits
    # The sigmoid without overflow: exp of minus |x| only, in float64, rounded once.
    x = logits.astype(np.float64)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(np.float32)


async def run(request: web.Request, served: ServedModel,
              encode: Callable[[TextEncoder], Encoded], chars: int, *,
              texts: int, priority: int | None = None, user: str | None = None,
              inputs: list[str] | None = None, per_token: bool = False,
              raw: bool = False) -> Ran:
    """Choose the variant, tokenize with `encode` (in a thread past THREAD_TOKENIZE_CHARS
    characters), run on a worker, count and log. `texts`: the inputs, for the bulk rule (a
    request of frontends.bulk_texts or more that names no priority runs a step below the
    default); `inputs` go to the access line when logging.log_inputs is on. `per_token`: every
    token's row (Submit.per_token); `raw`: the rows without the model's own normalisation
    (Submit.raw)."""
    cfg = request.app[CONFIG]
    request[MODEL_NAME] = served.spec.name
    key = sticky_key(request, served, user)
    variant = request.get(PINNED) or request.app[SPLITS].choose(
        served.spec.name, served.variants, key, request.app[POOL].ready_links)
    deadline, seconds, deadline_by = deadline_of(request, cfg.frontends.request_timeout_s)
    if deadline_by != "frontends.request_timeout_s":  # the client's own deadline, or its cap
        request[LOG_FIELDS].update(timeout_s=round(seconds, 3), timeout_by=deadline_by)
    given = request_priority(request, priority, None)
    priority = cfg.frontends.default_priority if given is None else given
    stepped = given is None and 0 < cfg.frontends.bulk_texts <= texts
    if stepped:  # A bulk request that names no priority: a step below, behind the queries
        priority = max(priority - 1, PRIORITY_RANGE[0])
    if priority != cfg.frontends.default_priority:
        request[LOG_FIELDS]["priority"] = priority
    request[CHOSEN] = (variant.name, priority)
    request[ARM] = variant
    inflight = request.app[INFLIGHT]
    if inflight[0] >= cfg.frontends.max_inflight:
        metrics.refused("inflight").inc()
        raise ApiError("overloaded", f"{inflight[0]} request{'s' * (inflight[0] != 1)} in "
                       "flight on this frontend (frontends.max_inflight)", retry_after=1,
                       reason="inflight")
    # What the worker would refuse, refused here before tokenizing: in a burst the 429 comes
    # before the frontend has tokenized the requests ahead of it, and the cores go to the work
    # admitted (shmserve.admission).
    try:
        refuse_early(request, variant, priority, deadline)
    except ApiError as exc:
        raise stepped_down(exc, stepped, texts) from None
    inflight[0] += 1
    gauge = metrics.inflight(str(request.app[INDEX]))
    gauge.inc()
    try:
        started = request[TOKENIZE_AT] = time.perf_counter()
        if chars > THREAD_TOKENIZE_CHARS:
            request.app[HEAP].note(chars)  # (its TRIM_CHARS are past THREAD_TOKENIZE_CHARS)
            enc = await off_loop(encode, variant.encoder, deadline)
        else:
            enc = encode(variant.encoder)
        if time.time() > deadline:  # no work goes to a worker past its deadline
            raise ApiError.deadline_passed()
        if per_token:
            json_bound(request, int(enc.offsets[-1]), variant.spec.width(per_token=True))
        if enc.tokens and chars > THREAD_TOKENIZE_CHARS:
            # Again with its tokens, and the heartbeats heard while it was tokenized.
            refuse_early(request, variant, priority, deadline, enc.tokens)
        request[TOKENIZE_MS] = (time.perf_counter() - started) * 1000
        request[CHARS] = chars
        fields = request[LOG_FIELDS]
        fields.update(texts=enc.count, tokens=enc.tokens,
                      tokenize_ms=round(request[TOKENIZE_MS], 3))
        if variant.name:
            fields["variant"] = variant.name
        if cfg.logging.log_inputs and inputs is not None:
            fields["inputs"] = inputs
        outcome = cached(request, variant, enc, raw) if not per_token else None
        if outcome is None:
            def dispatch(arm: Variant, enc: Encoded):
                return request.app[DISPATCHER].run(arm.unit, arm.spec.width(per_token), enc,
                                                   request[REQUEST_ID], deadline, priority,
                                                   per_token, raw)
            try:
                outcome = await dispatch(variant, enc)
            except ApiError as exc:
                # Its arm lost its last worker since it was chosen, the others not having
                # loaded it: an arm served takes it, as the choice gives one its share (an
                # outside check saw a 503 at a worker's drain)
                if exc.code != "model_not_loaded" or request.get(PINNED) or (
                        other := request.app[SPLITS].choose(
                            served.spec.name, served.variants, key,
                            request.app[POOL].ready_links)) is variant:
                    raise
                if other.encoder is not variant.encoder:  # (arms of different tokenizers)
                    enc = (await off_loop(encode, other.encoder, deadline)
                           if chars > THREAD_TOKENIZE_CHARS else encode(other.encoder))
                variant = request[ARM] = other
                request.pop(CACHED, None)  # (its lookup was the other arm's: nothing kept)
                request[CHOSEN] = (variant.name, priority)
                fields["variant"] = variant.name
                outcome = await dispatch(variant, enc)
            kept(request, outcome)
    except ApiError as exc:
        if exc.kind != "timeout":
            raise stepped_down(exc, stepped, texts) from None
        raise exc.set_by(deadline_by) from None
    finally:
        inflight[0] -= 1
        gauge.dec()
    name = served.spec.name
    if request.get(CACHED, ("",))[0] != "hit":  # (a cached answer ran through no model)
        metrics.texts(name).inc(enc.count)
        request[INPUTS] = request.get(INPUTS, 0) + enc.count
        metrics.tokens(name).inc(enc.tokens)
    if enc.truncated:
        metrics.truncated(name).inc(enc.truncated)
    metrics.input_tokens(name).observe_many(np.diff(enc.offsets).tolist())
    # The middleware adds the transfer and total stages once the response is rendered.
    request[STAGES] = {"tokenize": request[TOKENIZE_MS] / 1000,
                       "queue": outcome.result.queue_ms / 1000,
                       "inference": outcome.result.inference_ms / 1000}
    if outcome.attempts == 1:  # tokens ready to the reply back in the handler, less the worker's
        # time (a request sent again spent some on the lost worker: in no stage)
        tokenized_at = request[TOKENIZE_AT] + request[TOKENIZE_MS] / 1000
        worker_s = (outcome.result.queue_ms + outcome.result.inference_ms) / 1000
        handoff = request[STAGES]["handoff"] = max(
            0.0, outcome.received_at - tokenized_at - worker_s)
        request[LOG_FIELDS]["handoff_ms"] = round(handoff * 1000, 3)
    request[REPLIED_AT] = outcome.received_at
    request[REVISION] = outcome.revision
    request[VARIANT] = variant.name
    request[LOG_FIELDS].update(revision=outcome.revision, batch_size=outcome.result.batch_size,
                               worker=outcome.worker, queue_ms=round(outcome.result.queue_ms, 3),
                               inference_ms=round(outcome.result.inference_ms, 3))
    if outcome.attempts > 1:  # the time lost to a worker that went away is in no stage
        request[LOG_FIELDS]["attempts"] = outcome.attempts
    if outcome.workers:  # spread over several (frontend.dispatch): `worker` answered last
        request[LOG_FIELDS]["workers"] = list(outcome.workers)
    return Ran(served, variant, outcome, enc)


def stepped_down(error: ApiError, stepped: bool, texts: int) -> ApiError:
    """A 429 of a request the bulk rule ran a step below the default says so: its words (a
    queue's share for below-normal priority, the work ahead of it) were of a priority the
    client never named (a noted gap)."""
    if stepped and error.kind == "overloaded":
        error.message += (f" (a request of {texts} texts that names no priority runs a step "
                          "below the default, behind smaller ones: frontends.bulk_texts; "
                          "X-Priority, or the body's priority, sets its own)")
    return error


def cached(request: web.Request, variant: Variant, enc: Encoded, raw: bool) -> Outcome | None:
    """The response cache's answer (frontends.response_cache_mb), when it holds every input's
    row from the weights the arm serves now; else None, the lookup kept for `kept`."""
    cache = request.app[CACHE]
    if cache is None:
        return None
    started = time.perf_counter()
    revision = variant_revision(variant, request.app[POOL])
    if not revision:  # not heard yet: nothing to key by
        return None
    keys = cache.keys(variant.unit, revision, enc, raw)
    outcome = cache.answer(keys, revision, variant.spec.width())
    request[CACHED] = ("hit" if outcome is not None else "miss", time.perf_counter() - started,
                       keys, revision)
    metrics.cache(request[MODEL_NAME], request[CACHED][0]).inc()
    if outcome is not None:
        request[LOG_FIELDS]["cache"] = "hit"
    return outcome


def kept(request: web.Request, outcome: Outcome) -> None:
    """A computed outcome's rows into the response cache, where `cached` missed."""
    looked = request.get(CACHED)
    if looked is None:
        return
    started = time.perf_counter()
    cache = request.app[CACHE]
    cache.keep(looked[2], outcome, looked[3])
    request[CACHED] = ("miss", looked[1] + time.perf_counter() - started, None, looked[3])
    metrics.cache_bytes(str(request.app[INDEX])).set(cache.bytes)


async def off_loop(encode: Callable[[TextEncoder], Encoded], encoder: TextEncoder,
                   deadline: float) -> Encoded:
    """`encode(encoder)` in a thread, until the deadline (then 504). A client that goes away
    cancels the wait even when the thread has just finished: asyncio.wait_for (Python 3.11)
    returned the result then and swallowed the cancellation, so the request ran to the end for
    no one. Either way the thread stops at its next chunk of inputs (chunked.abandonable):
    left to finish, it held one of the executor's few threads for seconds for no one."""
    stop = threading.Event()

    def work(encoder: TextEncoder) -> Encoded:
        with abandonable(stop):
            return encode(encoder)

    tokenizing = asyncio.get_running_loop().run_in_executor(None, work, encoder)
    try:
        async with asyncio.timeout(deadline - time.time()):
            return await tokenizing
    except TimeoutError:
        raise ApiError.deadline_passed() from None
    finally:
        stop.set()  # (a thread that finished is not told anything it reads)


def refuse_early(request: web.Request, variant: Variant, priority: int, deadline: float,
                 tokens: int = 0) -> None:
    """429 now if every worker that serves `variant` would refuse the request by its admission
    rule (workers.refuse_past_deadline; frontend.pool.WorkerPool.behind)."""
    if not request.app[CONFIG].workers.refuse_past_deadline or time.time() >= deadline:
        return  # a deadline already passed is answered 504 (run)
    refusal = request.app[DISPATCHER].pool.behind(variant.unit, priority, deadline, tokens)
    if refusal is not None:
        metrics.refused("deadline").inc()
        raise ApiError("overloaded", f"{refusal.why}; retry later "
                       "(workers.refuse_past_deadline)", retry_after=refusal.retry_after_s,
                       reason="deadline")


def stage_headers(request: web.Request, outcome: Outcome) -> dict[str, str]:
    """The headers of a successful inference response: revision, batch, stage timings, and
    TEI's X-Compute-* (the middleware adds X-Total-Time and X-Compute-Time)."""
    headers = {
        "X-Model-Revision": outcome.revision,
        "X-Batch-Size": str(outcome.result.batch_size),
        "X-Compute-Type": request.app[POOL].links[outcome.worker].compute_type,
        "X-Compute-Characters": str(request[CHARS]),
        "X-Compute-Tokens": str(outcome.result.tokens),
        "X-Tokenization-Time": f"{request[TOKENIZE_MS]:.3f}",
        "X-Queue-Time": f"{outcome.result.queue_ms:.3f}",
        "X-Inference-Time": f"{outcome.result.inference_ms:.3f}",
    }
    if request.get(VARIANT):
        headers["X-Model-Variant"] = request[VARIANT]  # the A/B arm that served
    return headers
