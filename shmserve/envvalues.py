"""An environment variable's value as a config layer reads it (shmserve.layers): parsed as a
YAML scalar or flow sequence, with the text it was written as kept beside what YAML reads, so
that a string key takes the whole value as written (shmserve.typedtree) and every other key
YAML's reading."""

from __future__ import annotations

import re
from typing import Any

import yaml

# YAML's implicit types but dates: `revision: 2024-01-01` stays text (a file's and a
# variable's, a list's items too)
WITHOUT_DATES = {
    first: [r for r in resolvers if r[0] != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


class EnvInt(int):
    """An integer from an environment variable, with the text it was written as: a string key
    keeps that text (SHMSERVE__MODELS__0__REVISION=01 is "01", not "1"; typedtree)."""
    text: str


class EnvFloat(float):
    text: str


class EnvWord(str):
    """A word from an environment variable that YAML reads as a boolean (yes, no, on, off, true,
    false): a string key keeps the word (SHMSERVE__ADMIN__TOKEN=yes is "yes", not an error that
    it is not a string), a boolean key reads it as YAML does (`as_yaml`; typedtree)."""
    as_yaml: bool


NULLS = ("null", "Null", "NULL", "~")


class EnvText(str):
    """An environment variable's whole value as written, with what YAML reads in it: a string
    key takes the text (typedtree), every other key `parsed`, so that neither a secret nor a
    prompt is cut or re-read by YAML (SHMSERVE__ADMIN__TOKEN='ab #cd' was "ab"; '#key' in
    auth.api_keys was no key at all, an open server). `error`: why YAML could not read it
    (named only if a key that is not a string needs it)."""
    parsed: Any
    error: str


def env_value(raw: str) -> Any:
    if raw.strip() in NULLS:
        return None  # the key's default
    text = EnvText(raw)
    text.error = ""
    try:
        text.parsed = yaml.load(raw, _EnvLoader) if raw != "" else ""
    except yaml.YAMLError as exc:
        text.parsed, text.error = None, f"{raw!r} is not a YAML value ({type(exc).__name__})"
        return text
    parsed = text.parsed
    if isinstance(parsed, str) and raw.strip()[:1] in ("'", '"'):
        return _text(parsed, parsed)  # a quoted YAML string: its content
    if not isinstance(parsed, (list, dict, type(None))) and \
            (getattr(parsed, "text", None) or str(parsed)) == raw.strip():
        return _text(raw.strip(), parsed)  # YAML's own reading: without surrounding spaces
    if parsed is None:
        text.error = (f"{raw!r} reads as nothing in YAML (a comment after '#'?); quote it, or "
                      "write null for the default")
    return text


def _text(raw: str, parsed: Any) -> EnvText:
    text = EnvText(raw)
    text.parsed, text.error = parsed, ""
    return text


class _EnvLoader(yaml.SafeLoader):
    """YAML as safe_load reads it, but a boolean or a number, at any depth (a list's items
    too), keeps the text it was written as (EnvWord, EnvInt, EnvFloat)."""


def _keeping_text(construct: Any) -> Any:
    def constructor(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
        value = construct(loader, node)
        if isinstance(value, bool):
            word = EnvWord(node.value)
            word.as_yaml = value
            return word
        if isinstance(value, int) and not _DECIMAL.fullmatch(node.value):
            # YAML 1.1's other integers (010 is 8, 1:00 is 60, 0b11 is 3): nobody writing a
            # variable means those, so the text stays a word, and a number key refuses it
            return node.value
        number = (EnvInt if isinstance(value, int) else EnvFloat)(value)
        number.text = node.value
        return number
    return constructor


_DECIMAL = re.compile(r"[-+]?[1-9][0-9_]*|[-+]?0")


for _tag, _construct in (("bool", yaml.SafeLoader.construct_yaml_bool),
                         ("int", yaml.SafeLoader.construct_yaml_int),
                         ("float", yaml.SafeLoader.construct_yaml_float)):
    _EnvLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _keeping_text(_construct))
_EnvLoader.yaml_implicit_resolvers = WITHOUT_DATES
