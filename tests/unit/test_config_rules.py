"""Rules between config keys (shmserve.checks.check_relations): where each key was set, and
every rule broken said at once."""

import pytest

from shmserve import config
from shmserve.config import ConfigError


def test_a_rule_between_keys_names_where_each_was_set():
    """It named the first key's layer alone (base.yaml), when a variable had set the other
    (an outside check)."""
    with pytest.raises(ConfigError) as exc:
        config.load(environ={"SHMSERVE__FRONTENDS__REQUEST_TIMEOUT_S": "0.001"})
    message = str(exc.value)
    assert message.startswith("batching.max_wait_ms: "), message
    assert message.endswith("; frontends.request_timeout_s set in "
                            "SHMSERVE__FRONTENDS__REQUEST_TIMEOUT_S)"), message


def test_every_rule_between_keys_broken_is_said_at_once():
    """A short nginx.proxy_read_timeout_s broke two rules, said one at a time: a fix of the
    first met the second (an outside check). Each part names where its keys were set."""
    with pytest.raises(ConfigError) as exc:
        config.load(environ={"SHMSERVE__NGINX__PROXY_READ_TIMEOUT_S": "7",
                             "SHMSERVE__SERVER__GRPC_PORT": "8080"})
    said = str(exc.value).split("\n  and ")
    assert [part.split(":")[0] for part in said] == [
        "server.grpc_port", "admin.reload_timeout_s", "frontends.request_timeout_s"], said
    assert "(set in SHMSERVE__SERVER__GRPC_PORT; server.port set in " in said[0], said
    for part in said[1:]:
        assert "must be under nginx.proxy_read_timeout_s (7)" in part, part
        assert part.endswith("; nginx.proxy_read_timeout_s set in "
                             "SHMSERVE__NGINX__PROXY_READ_TIMEOUT_S)"), part
