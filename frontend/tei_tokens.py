"""TEI's tokenizer routes: `POST /tokenize` (texts, after the model's prompt, to TEI's
SimpleToken lists with byte offsets) and `POST /decode` (token ids back to text), bounded to what
the largest embedding request may hold. Registered by frontend.tei.add_routes."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import numpy as np
from aiohttp import web

from frontend import codec, request_headers, tasks
from frontend.app import CONFIG, MODEL_NAME, MODELS
from frontend.errors import ApiError
from frontend.schemas import (flag, mapping, model_name, one_or_many, prompt_name, required,
                              texts_or_ids)


async def tokenize(request: web.Request) -> web.Response:
    cfg, deadline = _tokenizer_request(request)
    body = mapping(await codec.read_body(request))
    given = one_or_many(required(body, "inputs"), "inputs", cfg.limits)
    special = flag(body, "add_special_tokens", True)
    model = request.app[MODELS].resolve(model_name(body))
    request[MODEL_NAME] = model.spec.name
    # The texts as the model reads them: after its prompt (the default one when none is named).
    given = model.encoder.prompted(given, prompt_name(body))
    budget = _budget(cfg, model)

    def run() -> list[list[dict[str, Any]]]:
        encodings: list = []
        tokens = 0
        for at in range(0, len(given), 16):  # in chunks, to stop soon past the budget
            chunk = model.encoder.tokenize(given[at:at + 16], special)
            tokens += sum(len(e.ids) for e in chunk)
            if tokens > budget:
                raise _over_budget("inputs", "tokens", "/tokenize", budget)
            encodings += chunk
        return [_tokens(text, enc) for text, enc in zip(given, encodings)]

    return await _tokenizer_answer(request, run, sum(map(len, given)), deadline)


async def decode(request: web.Request) -> web.Response:
    cfg, deadline = _tokenizer_request(request)
    body = mapping(await codec.read_body(request))
    given = required(body, "ids")
    # texts_or_ids reads a non-list or strings as texts, and would name texts in its refusal.
    rows = (texts_or_ids(given, "ids", cfg.limits)[1] if isinstance(given, list)
            and not any(isinstance(v, str) for v in given) else None)
    if rows is None:
        raise ApiError("invalid_request", "'ids' must be a list of token ids (integers) or a "
                       "list of such lists; /tokenize turns texts into ids", param="ids")
    special = flag(body, "skip_special_tokens", True)
    model = request.app[MODELS].resolve(model_name(body))
    request[MODEL_NAME] = model.spec.name
    ids = sum(map(len, rows))
    if ids > (budget := _budget(cfg, model)):
        raise _over_budget("ids", "ids", "/decode", budget)
    # ~4 characters a token, for when to leave the event loop
    return await _tokenizer_answer(request, lambda: model.encoder.decode(rows, special),
                                   4 * ids, deadline)


def _tokenizer_request(request: web.Request) -> tuple[Any, tuple[float, str]]:
    """/tokenize's and /decode's start: the headers every route takes, checked as everywhere
    (the deadline is kept to at the end); the config and the deadline (when it passes, what
    set it: request_headers.deadline_of)."""
    cfg = request.app[CONFIG]
    at, _, by = request_headers.deadline_of(request, cfg.frontends.request_timeout_s)
    request_headers.request_priority(request, None, cfg.frontends.default_priority)
    return cfg, (at, by)


def _budget(cfg, model) -> int:
    """What /tokenize and /decode answer at most in a request, in tokens: what the largest
    embedding request may hold (each token is ~100 bytes of /tokenize's JSON; 80 texts of
    99,000 characters made a 136 MB answer)."""
    return cfg.limits.max_texts_per_request * model.spec.max_tokens


def _over_budget(param: str, what: str, route: str, budget: int) -> ApiError:
    return ApiError("too_large", f"'{param}' has over {budget} {what}; {route} answers at most "
                    f"{budget} a request (limits.max_texts_per_request x the model's input "
                    "limit)", param=param)


async def _tokenizer_answer(request: web.Request, work: Callable[[], Any], chars: int,
                            deadline: tuple[float, str]) -> web.Response:
    """`work`'s result, computed off the event loop for a large request (as /predict
    tokenizes), unless the deadline passed meanwhile."""
    if chars > tasks.THREAD_TOKENIZE_CHARS:
        out = await asyncio.get_running_loop().run_in_executor(None, work)
    else:
        out = work()
    at, by = deadline
    if time.time() > at:
        raise ApiError.deadline_passed().set_by(by)
    return codec.render(request, out)


def _tokens(text: str, encoding) -> list[dict[str, Any]]:
    """TEI's SimpleToken list: special tokens get their token text and no offsets; others the
    slice of the input they cover, with byte offsets (the tokenizer gives character ones)."""
    byte_at = np.arange(len(text) + 1)
    if not text.isascii():  # UTF-8 length of each code point, summed
        points = np.frombuffer(text.encode("utf-32-le"), "<u4")
        sizes = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
        byte_at[1:] = np.cumsum(sizes)
    out = []
    for tid, token, (start, stop), special in zip(encoding.ids, encoding.tokens,
                                                   encoding.offsets,
                                                   encoding.special_tokens_mask):
        if special:
            out.append({"id": tid, "text": token, "special": True, "start": None,
                        "stop": None})
        else:
            out.append({"id": tid, "text": text[start:stop], "special": False,
                        "start": int(byte_at[start]), "stop": int(byte_at[stop])})
    return out
