"""A config as an operator is shown it: credentials hidden (`shmserve config`, the
differences `apply`, `restart` and `up` print), every key by its dotted path, and what differs
between two configs."""

from __future__ import annotations

import dataclasses
import json
import urllib.parse
from typing import Any

from shmserve.config import Config


# Keys whose values are credentials: `shmserve config` and config differences hide them.
SECRET_KEYS = ("admin.token", "auth.api_keys")


def redacted(cfg: Config) -> Config:
    """The config with its credentials (SECRET_KEYS) shown as *** (an empty one stays empty:
    whether it is set is worth seeing), for printing."""
    return dataclasses.replace(
        cfg, admin=dataclasses.replace(cfg.admin, token="***" if cfg.admin.token else ""),
        auth=dataclasses.replace(cfg.auth, api_keys=["***"] * len(cfg.auth.api_keys)),
        tracing=dataclasses.replace(cfg.tracing,
                                    otlp_endpoint=without_userinfo(cfg.tracing.otlp_endpoint)),
        models=[dataclasses.replace(
            model, source=without_userinfo(model.source),
            variants=[dataclasses.replace(v, source=without_userinfo(v.source))
                      for v in model.variants]) for model in cfg.models])


def without_userinfo(url: str) -> str:
    """A URL with the user and password it may carry (http://user:pass@host/) shown as ***,
    and its query string too (a collector's ?token=...)."""
    parts = urllib.parse.urlsplit(url)
    if "@" in parts.netloc:
        parts = parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2])
    if parts.query:
        parts = parts._replace(query="***")
    return parts.geturl()


def flat(cfg: Config) -> dict[str, Any]:
    """Every key of a config by its dotted path (lists are single values: models, devices)."""
    return flat_tree(dataclasses.asdict(cfg))


def flat_tree(tree: Any) -> dict[str, Any]:
    """Every leaf of a config's tree (a file's too) by its dotted path, lists single values."""
    out: dict[str, Any] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else str(key))
        else:
            out[path] = node
    walk(tree, "")
    return out


def changed_keys(old: Config, new: Config) -> list[str]:
    """The dotted keys whose values differ (flat's), sorted."""
    a, b = flat(old), flat(new)
    return [key for key in sorted(a.keys() | b.keys()) if a.get(key) != b.get(key)]


def differences(old: Config, new: Config) -> list[str]:
    """The keys whose values differ, as `key: old -> new` (secrets: `key: changed`)."""
    shown = flat(redacted(old)), flat(redacted(new))  # an endpoint's password too
    # changed: a secret, or a value whose hidden part alone differs (an endpoint's password:
    # "http://***@…" -> "http://***@…" read as no change, an outside check)
    return [f"{key}: changed" if key in SECRET_KEYS or shown[0].get(key) == shown[1].get(key)
            else f"{key}: {json.dumps(shown[0].get(key))} -> {json.dumps(shown[1].get(key))}"
            for key in changed_keys(old, new)]
