"""What `shmserve config`, apply's and restart's differences and config errors show of a
credential held in a URL: never the user and password, nor a query string's token."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from shmserve import config, configview, sources
from shmserve.config import ConfigError
from shmserve.model_files import ModelSourceError

SECRET = "pw-secret-42"


def test_a_model_sources_user_and_password_are_hidden_in_the_config_and_its_differences():
    # refused by the model check at up, but printed first by `config`, and by apply's and
    # restart's differences (an outside check)
    old = config.load()
    new = config.load(environ={**os.environ, "SHMSERVE__MODELS__0__SOURCE":
                               f"https://u:{SECRET}@hub.example.com/m"})
    shown = configview.redacted(new)
    assert shown.models[0].source == "https://***@hub.example.com/m"
    assert SECRET not in json.dumps(dataclasses.asdict(shown))
    changed = configview.differences(old, new)
    assert changed and not any(SECRET in line for line in changed), changed


def test_an_a_b_arms_source_is_hidden_too():
    cfg = config.from_tree({"models": [{"name": "ab", "variants": [
        {"name": "a", "source": "/m/a"},
        {"name": "b", "source": f"https://u:{SECRET}@hub.example.com/b"}]}]})
    shown = configview.redacted(cfg)
    assert [v.source for v in shown.models[0].variants] == ["/m/a",
                                                            "https://***@hub.example.com/b"]


def test_a_query_strings_token_is_hidden():
    assert configview.without_userinfo(f"https://c:4318/v1/traces?token={SECRET}") == \
        "https://c:4318/v1/traces?***"
    assert configview.without_userinfo("http://c:4318/v1/traces") == "http://c:4318/v1/traces"


def test_a_change_of_the_hidden_part_alone_reads_changed():
    # "http://***@c..." -> "http://***@c..." read as no change at all (an outside check)
    old, new = (config.load(environ={**os.environ, "SHMSERVE__TRACING__OTLP_ENDPOINT":
                                     f"http://u:{password}@c:4318/v1/traces"})
                for password in ("one", "two"))
    assert configview.differences(old, new) == ["tracing.otlp_endpoint: changed"]


def test_a_refused_endpoint_without_its_scheme_is_quoted_without_its_password():
    with pytest.raises(ConfigError) as refused:
        config.load(environ={**os.environ, "SHMSERVE__TRACING__OTLP_ENDPOINT":
                             f"user:{SECRET}@127.0.0.1:4318/v1/traces"})
    assert SECRET not in str(refused.value)
    assert "'***@127.0.0.1:4318/v1/traces'" in str(refused.value)


def test_a_url_as_a_model_source_is_refused_as_one_without_its_password():
    # it was looked for as a directory, and the error quoted the path, password and all
    with pytest.raises(ModelSourceError) as refused:
        sources.resolve_source(f"https://u:{SECRET}@hub.example.com/m", [])
    assert SECRET not in str(refused.value)
    assert "is a URL: shmserve downloads nothing" in str(refused.value)
