"""Request validation at the HTTP edge: bodies in, typed requests out, or a 4xx naming the field.

"One value or a list" is resolved here; nothing past this module sees it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from frontend.errors import ApiError
from shmserve.config import LimitsConfig
from shmserve.protocol import PRIORITY_RANGE, priority_level

ENCODING_FORMATS = ("float", "base64")
# What a JSON (or msgpack) value that is not a token id is, in an error message.
JSON_KINDS = {bool: "a boolean", type(None): "null", str: "a string", dict: "an object",
              list: "a list", bytes: "bytes"}


@dataclass(frozen=True, slots=True)
class EmbedRequest:
    texts: list[str]  # empty when token_ids is given
    model: str | None
    encoding_format: str = "float"
    priority: int | None = None  # from the body; the X-Priority header is read by the route
    token_ids: list[list[int]] | None = None  # pre-tokenized input, used as given
    dimensions: int | None = None  # keep this many leading components (Matryoshka)
    truncate: bool | None = None  # None: limits.truncate
    truncation_direction: str = "right"
    user: str | None = None  # a client id; an A/B split may route by it (models.sticky_key)
    prompt_name: str | None = None  # one of the model's prompts (None: its default, if any)


def parse_openai_embeddings(body: Any, limits: LimitsConfig) -> EmbedRequest:
    body = mapping(body)
    given, ids = texts_or_ids(required(body, "input"), "input", limits)
    fmt = body.get("encoding_format", "float")
    if fmt is None:
        fmt = "float"
    if fmt not in ENCODING_FORMATS:
        raise ApiError("invalid_request", "'encoding_format' must be 'float' or 'base64'",
                       param="encoding_format")
    return EmbedRequest(given, model_name(body), fmt, body_priority(body), token_ids=ids,
                        dimensions=dimensions(body), user=user(body),
                        prompt_name=prompt_name(body, ids is not None))


def texts_or_ids(value: Any, param: str, limits: LimitsConfig
                 ) -> tuple[list[str], list[list[int]] | None]:
    """A string, a list of strings, one token-id list, or a list of token-id lists.

    Token ids are checked here for shape and type only; the model's tokenizer checks their
    range and length (`TextEncoder.from_ids`). A list that is neither kind is named for what it
    holds (numbers that are not integers, texts mixed with token ids), not as a bad text. A
    whole float is that id (`_token_ids`)."""
    if isinstance(value, list) and value and _number(value[0]):
        _check_row(value, param, param, limits)  # before any pass over its elements
    if isinstance(value, list) and value and all_ints(value):
        return [], [value]  # one pass, no copy: the common case
    if isinstance(value, list) and value and all(_number(v) for v in value):
        return [], [_token_ids(value, param, param)]
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        check_count(value, param, limits, "token lists")
        rows = []
        for i, row in enumerate(value):
            if not row:
                raise ApiError("invalid_request", f"'{param}[{i}]' must be a non-empty list of "
                               "token ids (integers)", param=param)
            _check_row(row, f"{param}[{i}]", param, limits)
            rows.append(_token_ids(row, f"{param}[{i}]", param))
        return [], rows
    if isinstance(value, list) and any(isinstance(v, list) for v in value):
        raise ApiError("invalid_request", f"'{param}' mixes token-id lists with other values; "
                       "send a list of texts or a list of token-id lists, not both", param=param)
    if isinstance(value, list) and any(_number(v) for v in value):
        if not any(isinstance(v, str) for v in value):
            _token_ids(value, param, param)
        raise ApiError("invalid_request", f"'{param}' mixes texts with token ids; send a list "
                       "of texts or a list of token ids, not both", param=param)
    return one_or_many(value, param, limits, ids_too=True), None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_row(row: list, name: str, param: str, limits: LimitsConfig) -> None:
    """A token-id row is bounded as a text's characters are (limits.max_text_chars): a body of
    1.6M ids (gzip makes that 12 KB) was checked id by id on the event loop, ~1 s each, and
    fifty at once starved the frontend's pings until the workers killed it (an outside
    check)."""
    if len(row) > limits.max_text_chars:
        raise ApiError("too_large", f"{name} has {len(row)} token ids; the limit is "
                       f"{limits.max_text_chars} (limits.max_text_chars, which bounds a row "
                       "of ids as it does a text's characters)", param=param)


_INT = {int}


def all_ints(row: list) -> bool:
    """Whether every element is an integer and none a bool (`is_int` of each), at C speed:
    a decoded body's integers are exactly int."""
    return set(map(type, row)) <= _INT


def _token_ids(row: list, name: str, param: str) -> list[int]:
    """`row` as token ids: itself when every element is an integer (no copy, the common case),
    else with its whole floats as those integers (`whole`); ApiError naming the first element
    that is not a token id."""
    if all_ints(row):
        return row
    row = [whole(v) for v in row]
    for j, v in enumerate(row):
        if not is_int(v):
            # orjson reads an integer past 64 bits as a float: say so, it looks like an int.
            shown = (f"{v:.3g}, an integer past 64 bits" if v.is_integer() and abs(v) >= 2**63
                     else f"{v!r}, a float") if isinstance(v, float) else JSON_KINDS.get(
                type(v), "not an integer")
            raise ApiError("invalid_request", f"'{name}[{j}]' is {shown}; token ids must be "
                           "integers in [0, the model's vocabulary size)", param=param)
    return row


def dimensions(body: dict) -> int | None:
    return count(body, "dimensions")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def whole(value: Any) -> Any:
    """A whole float (8.0) as that integer, anything else as it is: JSON has one number type,
    and the OpenAPI document's integer (JSON Schema's) takes it (a client validating by it sent
    3.0 and got a 400, an outside check). Every integer field of a body reads through this."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def count(body: dict, key: str, within: str = "") -> int | None:
    """An optional integer >= 1 (top_k, top_n, dimensions); `within`: the object holding it
    (parameters), for the message. A whole float is that integer (`whole`)."""
    value = whole(body.get(key))
    if value is not None and (not is_int(value) or value < 1):
        name = f"{within}.{key}" if within else key
        # (a JSON integer past 2**53 reads as a float: said, as it is an integer to the client)
        raise ApiError("invalid_request", f"'{name}' must be an integer >= 1 (and under 2**53)",
                       param=within or key)
    return value


def flag(body: dict, key: str, default: bool) -> bool:
    """An optional boolean; absent or null is `default`."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError("invalid_request", f"'{key}' must be a boolean", param=key)
    return value


def one_or_many(value: Any, param: str, limits: LimitsConfig, ids_too: bool = False
                ) -> list[str]:
    """A string or a list of strings, as a list: one string is one text, and the response has
    one row for it, as /v1/embeddings answers a string with a `data` of one. `ids_too`: the
    field also takes token ids (`texts_or_ids`), and a bad element's message says so."""
    if isinstance(value, str):  # named as the field, not as an element of a list
        check_text(value, f"'{param}'", param, limits)
        return [value]
    if not isinstance(value, list):
        takes = ("a string, a list of strings, a list of token ids (integers) or a list of such "
                 "lists" if ids_too else "a string or a list of strings")
        raise ApiError("invalid_request", f"'{param}' must be {takes}", param=param)
    return texts(value, param, limits, ids_too)


def query(body: dict, limits: LimitsConfig) -> str:
    """A rerank request's query: one string, held to the limits of any text."""
    value = required(body, "query")
    if not isinstance(value, str):
        raise ApiError("invalid_request", "'query' must be a string", param="query")
    check_text(value, "'query'", "query", limits)
    return value


def required(body: dict, key: str) -> Any:
    if key not in body:
        raise ApiError("invalid_request", f"'{key}' is required", param=key)
    return body[key]


def parse_predict(body: Any, limits: LimitsConfig) -> EmbedRequest:
    body = mapping(body)
    return EmbedRequest(one_or_many(required(body, "texts"), "texts", limits), model_name(body),
                        priority=body_priority(body), user=user(body),
                        prompt_name=prompt_name(body))


def prompt_name(body: dict, token_ids: bool = False) -> str | None:
    """One of the model's prompts by name (its TextEncoder checks which it has), "" for none
    (not even a default prompt); not with token ids, which are used as given."""
    value = body.get("prompt_name")
    if value is not None and not isinstance(value, str):
        raise ApiError("invalid_request", "'prompt_name' must be a string (\"\": no prompt) or "
                       "null", param="prompt_name")
    if value and token_ids:
        raise ApiError("invalid_request", "'prompt_name' applies to texts; token ids are used "
                       "as given (put the prompt's ids in them)", param="prompt_name")
    return value


def user(body: dict) -> str | None:
    value = body.get("user")
    if value is not None and not isinstance(value, str):
        raise ApiError("invalid_request", "'user' must be a string", param="user")
    return value


def mapping(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ApiError("invalid_request", "the request body must be an object")
    return body


def model_name(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ApiError("invalid_request", "'model' must be a non-empty string", param="model")
    return model


def texts(value: Any, param: str, limits: LimitsConfig, ids_too: bool = False) -> list[str]:
    """A list of texts, each checked; where one string is also taken, see `one_or_many`."""
    if not isinstance(value, list):
        raise ApiError("invalid_request", f"'{param}' must be a list of strings", param=param)
    if not value:
        raise ApiError("invalid_request", f"'{param}' must not be empty", param=param)
    check_count(value, param, limits, "texts")
    for i, text in enumerate(value):
        if not isinstance(text, str):
            if ids_too:  # a boolean, null, an object: neither kind the field takes
                raise ApiError("invalid_request", f"'{param}[{i}]' is "
                               f"{JSON_KINDS.get(type(text), type(text).__name__)}; '{param}' "
                               "takes texts (strings) or token ids (integers)", param=param)
            raise ApiError("invalid_request", f"'{param}[{i}]' must be a string", param=param)
        check_text(text, f"'{param}[{i}]'", param, limits)
    return value


def check_count(value: list, param: str, limits: LimitsConfig, what: str) -> None:
    """413 for more inputs than limits.max_texts_per_request."""
    if len(value) > limits.max_texts_per_request:
        raise ApiError("too_large", f"'{param}' has {len(value)} {what}; the limit is "
                       f"{limits.max_texts_per_request} (limits.max_texts_per_request)",
                       param=param)


def check_text(text: str, name: str, param: str, limits: LimitsConfig) -> None:
    """One text (`name` says which in the message) against the limits of any text."""
    if not text:
        raise ApiError("invalid_request", f"{name} must not be empty", param=param)
    if not text.isascii() and not _utf8(text):
        raise ApiError("invalid_request", f"{name} is not valid Unicode (a lone surrogate "
                       "escape)", param=param)
    if len(text) > limits.max_text_chars:
        raise ApiError("too_large", f"{name} has {len(text)} characters; the limit is "
                       f"{limits.max_text_chars} (limits.max_text_chars)", param=param)


def parse_priority(value: object, param: str) -> int:
    """A priority level: low | normal | high, or an integer in [-10, 10]; higher runs first."""
    level = priority_level(value)
    if level is None:
        raise ApiError("invalid_request", f"'{param}' must be low, normal, high or an integer "
                       f"from {PRIORITY_RANGE[0]} to {PRIORITY_RANGE[1]}", param=param)
    return level


def body_priority(body: dict) -> int | None:
    value = whole(body.get("priority"))
    return None if value is None else parse_priority(value, "priority")


def _utf8(text: str) -> bool:
    # JSON may escape a lone surrogate ("\\ud800"); the tokenizer cannot take one.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
