"""A parsed YAML tree into frozen dataclasses, strictly: unknown keys, missing required keys,
wrong types and values outside their range are `ConfigError`s that name the key path
(``workers.cpu_workers``, ``models[0].dtype``). The schema itself is shmserve.config."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from typing import Any, Callable, Literal, Mapping

# Range checks beyond the types: key path -> (predicate, what is expected).
Check = tuple[Callable[[Any], bool], str]


class ConfigError(ValueError):
    """A configuration value is missing, malformed or out of range; the message names the key
    (several rules broken at once: one message each, joined by ConfigError.AND)."""

    AND = "\n  and "


def build(cls: type, tree: Any, checks: Mapping[str, Check], prefix: str = "") -> Any:
    """`tree` (parsed YAML) as an instance of dataclass `cls`, every value checked against
    its type hint, then against `checks[key path]` when there is one."""
    if not isinstance(tree, Mapping):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {_show(tree, prefix)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(tree) - names)
    if unknown:
        near = difflib.get_close_matches(str(unknown[0]), sorted(names), n=1, cutoff=0.75)
        raise ConfigError(f"{_join(prefix, unknown[0])}: unknown key"
                          + (f" (did you mean {_join(prefix, near[0])}?)" if near else ""))
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = _join(prefix, f.name)
        if f.name not in tree:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{key}: required")
            continue
        value = _coerce(hints[f.name], tree[f.name], key, checks)
        check = checks.get(key)
        if check and not check[0](value):
            raise ConfigError(f"{key}: expected {check[1]}, got {_show(tree[f.name], key)}")
        kwargs[f.name] = value
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, key: str,
            checks: Mapping[str, Check]) -> Any:
    origin = typing.get_origin(hint)
    if hasattr(value, "parsed") and origin not in (typing.Union, types.UnionType):
        # An environment variable's value (envvalues.EnvText): a string key takes it as written,
        # any other what YAML reads in it.
        if hint is str:
            return str(value)
        if value.error:
            error = value.error if not _SECRET.fullmatch(key) else \
                value.error.replace(repr(str(value)), "its value (not shown: a secret)")
            raise ConfigError(f"{key}: {error}")
        value = value.parsed
    if dataclasses.is_dataclass(hint):
        return build(hint, value, checks, key)
    if origin in (typing.Union, types.UnionType):
        errors = []
        options = typing.get_args(hint)
        if isinstance(getattr(value, "parsed", None), (list, dict)):
            # an environment variable YAML reads as a list or mapping: not the string option
            options = tuple(o for o in options if o is not str)
        for option in options:
            try:
                return _coerce(option, value, key, checks)
            except ConfigError as exc:
                errors.append(str(exc))
        # A list (or mapping) where one option is a list (a mapping): that option's own error
        # names the item at fault ("expected a string or a list, got [0, 'x']" did not)
        plain = getattr(value, "parsed", value)
        shaped = [error for option, error in zip(options, errors)
                  if (typing.get_origin(option) is list and isinstance(plain, list))
                  or ((typing.get_origin(option) is dict or dataclasses.is_dataclass(option))
                      and isinstance(plain, Mapping))]
        if len(shaped) == 1:
            raise ConfigError(shaped[0])
        raise ConfigError(f"{key}: expected {_describe(hint)}, got {_show(value, key)}")
    if origin is Literal:
        allowed = typing.get_args(hint)
        # An environment word as written, then as YAML reads it (envvalues.EnvWord: yes -> true)
        for each in (value, getattr(value, "as_yaml", value)):
            text = str(each).lower() if isinstance(each, bool) else each
            if text in allowed:
                return str(text) if isinstance(text, str) else text
        raise ConfigError(f"{key}: expected one of {', '.join(map(str, allowed))}, "
                          f"got {_show(value, key)}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {_show(value, key)}")
        (item,) = typing.get_args(hint)
        return [_coerce(item, v, f"{key}[{i}]", checks) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {_show(value, key)}")
        key_hint, item = typing.get_args(hint)
        return {_coerce(key_hint, k, f"{key} (a key)", checks): _coerce(item, v, f"{key}.{k}",
                                                                        checks)
                for k, v in value.items()}
    if hint is bool:
        value = getattr(value, "as_yaml", value)  # an environment word (envvalues.EnvWord)
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {_show(value, key)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {_show(value, key)}")
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value):  # .inf passed, and crashed the rendering of `up`
            raise ConfigError(f"{key}: expected a finite number, got {_show(value, key)}")
        return float(value)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected a string, got {_show(value, key)}")
        # A number from the environment as it was written (envvalues.EnvInt: 01 stays "01").
        return getattr(value, "text", None) or str(value)
    raise ConfigError(f"{key}: unsupported type {hint}")  # a bug in the schema, not the input


_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _describe(hint: Any) -> str:
    names = []
    for option in typing.get_args(hint):
        if typing.get_origin(option) is Literal:
            names.append(", ".join(map(str, typing.get_args(option))))
        elif typing.get_origin(option) is list:
            names.append("a list")
        else:
            names.append(_KINDS.get(option, getattr(option, "__name__", str(option))))
    return " or ".join(names)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# Decimal number text (not 010, which YAML 1.1 reads as octal and a number key refuses)
_NUMBER_TEXT = re.compile(r"[-+]?((0|[1-9][0-9]*)(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+)?")


# Keys whose values are never shown in an error: an error's text goes to up's stderr, so to CI
# and container logs (SHMSERVE__AUTH__API_KEYS=sk-... said "expected a list, got 'sk-...'")
_SECRET = re.compile(r"(auth\.api_keys|admin\.token)(\[\d+\])?")
_USERINFO = re.compile(r"(^|//)[^/@\s]+@")


def _show(value: Any, key: str) -> str:
    if _SECRET.fullmatch(key):
        kind = "a string" if isinstance(value, str) else f"a {type(value).__name__}"
        return f"{kind} (not shown: a secret)"
    if not isinstance(getattr(value, "parsed", ""), (str, type(None))):
        # An environment variable YAML reads as a number (or a list...): shown as that, not as
        # "the text '70000' (a quoted number...)" for SHMSERVE__SHM__ARENA_MB=70000 past its
        # range (an outside check); one quoted in the variable stays text.
        value = value.parsed
    # a URL's user and password (a tracing endpoint's, a model source's), with or without
    # its scheme: a refused value was quoted whole (an outside check)
    text = repr(_USERINFO.sub(r"\1***@", str(value)) if isinstance(value, str) else value)
    text = text if len(text) <= 60 else text[:57] + "..."
    if isinstance(value, str):
        if re.fullmatch(r"[-+]?0[0-9_]+", value.strip()):  # "expected an integer, got '010'"
            return f"the text {text} (a leading zero: YAML 1.1 reads 010 as octal 8; write " \
                   "the number without it)"
        if not _NUMBER_TEXT.fullmatch(str(value).strip()):
            return text
        # A number read as text: YAML 1.1 reads 1e9 (no dot, no exponent sign) as a string,
        # and a quoted number is one; "expected a number, got '1e9'" read as a contradiction
        # (an outside check).
        if "e" in str(value).lower():
            return f"the text {text} (YAML reads an exponent as a number only with a dot and " \
                   "a sign, 1.0e+3; or write the number in full)"
        return f"the text {text} (a quoted number: write it without quotes)"
    return text
