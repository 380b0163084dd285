"""The values a config key may take beyond its type: durations bounded, sizes the OS is given
bounded, and what is written into supervisord.conf checked with the config, before anything is
rendered."""

import json
import re

import pytest

from shmserve import config
from shmserve.config import ConfigError


@pytest.mark.parametrize("key", [
    "server.drain_timeout_s", "frontends.no_worker_wait_s", "frontends.hung_kill_s",
    "workers.heartbeat_interval_s", "workers.heartbeat_timeout_s", "workers.hung_kill_s",
    "workers.start_timeout_s", "workers.stalled_pass_s", "workers.ready_timeout_s",
    "workers.empty_cache_idle_s", "frontends.request_timeout_s", "admin.reload_timeout_s"])
def test_a_duration_is_at_most_a_day(key):
    """server.drain_timeout_s: 1.0e+12 rendered stopwaitsecs=1000000000005 (an outside check);
    every duration is rendered or waited on."""
    name = "SHMSERVE__" + key.upper().replace(".", "__")
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: expected a number .*to 86400, "):
        config.load(environ={name: "1.0e+12"})


def test_sizes_rendered_or_given_to_the_os_are_bounded():
    """A backlog past a C int failed every frontend's listen(); a log size is rendered."""
    for name, value in (("FRONTENDS__LISTEN_BACKLOG", "65536"),
                        ("LOGGING__MAX_BYTES", str((1 << 40) + 1)),
                        ("LOGGING__FLUSH_INTERVAL_MS", "1.0e+12"),
                        ("WORKERS__TORCH_THREADS", "1000000000")):
        key = name.lower().replace("__", ".")
        with pytest.raises(ConfigError, match=rf"^{key}: expected "):
            config.load(environ={f"SHMSERVE__{name}": value})
    cfg = config.load(environ={"SHMSERVE__SERVER__DRAIN_TIMEOUT_S": "86400",
                               "SHMSERVE__FRONTENDS__LISTEN_BACKLOG": "65535"})
    assert (cfg.server.drain_timeout_s, cfg.frontends.listen_backlog) == (86400, 65535)


def test_a_value_written_into_supervisord_conf_is_checked_with_the_config(tmp_path):
    """A newline in workers.cuda_alloc_conf rendered, then supervisord did not start ("No
    closing quotation in section 'program:worker-0'", no key named: an outside check); a
    double quote was named as PYTORCH_CUDA_ALLOC_CONF, at rendering."""
    def refused(name, value, key):
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: expected .* \(set in "
                                              rf"SHMSERVE__{name}\)$"):
            config.load(environ={f"SHMSERVE__{name}": value})

    for value in ("expandable_segments:True\nfoo=bar", 'a"b', "a ;b", "a #b", "a'"):
        refused("WORKERS__CUDA_ALLOC_CONF", value, "workers.cuda_alloc_conf")
    for value in ("expandable_segments:True,max_split_size_mb:128", "",
                  "roundup_power2_divisions:[256:1,512:2,>:8], backend:cudaMallocAsync"):
        assert config.load(environ={"SHMSERVE__WORKERS__CUDA_ALLOC_CONF": value}
                           ).workers.cuda_alloc_conf == value
    for value in ("/usr/sbin/nginx\nx", "nginx;x", "nginx #x"):
        refused("NGINX__BINARY", value, "nginx.binary")
    given = tmp_path / "my.yaml"
    for value in (f"{tmp_path}/run\n", f"{tmp_path}/a\nb", f"{tmp_path}/a$b", f"{tmp_path}/a%b",
                  f"{tmp_path}/a ;b", f"{tmp_path}/a\"b", f"{tmp_path}/a\\b"):
        given.write_text(f"server: {{run_dir: {json.dumps(value)}}}\n")
        with pytest.raises(ConfigError, match=r"^server.run_dir: .* may not hold control"):
            config.load(extra=given, environ={})
    for value in (f"{tmp_path}/my models/run", f"{tmp_path}/modèles/run"):  # quoted in both
        given.write_text(f"server: {{run_dir: {json.dumps(value)}}}\n")
        assert str(config.load(extra=given, environ={}).run_dir) == value


def test_a_final_newline_is_no_part_of_a_checked_value(tmp_path):
    """A pattern's "$" matches before a final newline: an API key or admin token ending in one
    (a file's `key: |` block, a variable from `$(cat key)` kept whole) was taken, and no header
    can carry it, so the key never worked, silently; a variant's name, a sticky key and the
    OTLP endpoint likewise."""
    given = tmp_path / "my.yaml"
    for tree, key in (({"auth": {"api_keys": ["abcdefgh12\n"]}}, "auth.api_keys"),
                      ({"admin": {"token": "abcdefgh12\n"}}, "admin.token"),
                      ({"tracing": {"otlp_endpoint": "http://collector:4318/v1/traces\n"}},
                       "tracing.otlp_endpoint"),
                      ({"models": [{"name": "m", "sticky_key": "user\n", "variants": [
                          {"name": "a", "source": "/m/a", "weight": 1}]}]}, "sticky_key"),
                      ({"models": [{"name": "m", "variants": [
                          {"name": "a\n", "source": "/m/a", "weight": 1}]}]}, "variants")):
        given.write_text(json.dumps(tree))
        with pytest.raises(ConfigError, match=re.escape(key)):
            config.load(extra=given, environ={})
        given.write_text(json.dumps(tree).replace("\\n", ""))
        try:
            config.load(extra=given, environ={})
        except ConfigError as exc:  # the same value without the newline is not what is refused
            assert key not in str(exc).split(":")[0], exc


def test_an_otlp_endpoint_the_exporter_cannot_post_to_is_refused():
    """`up` took endpoints that can never work (no host, a port out of range or not a
    number, an unclosed IPv6 bracket, which also made `shmserve config` fail with a
    traceback), and a base URL without the path (the exporter posts to the URL as given; a
    collector answers its / with 404): tracing dead, a line per batch in the frontends' logs
    (an outside check)."""
    for bad in ("http:///v1/traces", "http://127.0.0.1:99999/v1/traces",
                "http://127.0.0.1:abc/v1/traces", "http://[::1/v1/traces",
                "http://127.0.0.1:4318", "http://127.0.0.1:4318/", "ftp://c/v1/traces",
                "collector:4318/v1/traces", "http://c /v1/traces"):
        with pytest.raises(ConfigError, match=r"^tracing.otlp_endpoint: .*/v1/traces"):
            config.load(environ={"SHMSERVE__TRACING__OTLP_ENDPOINT": bad})
    for good in ("", "http://c:4318/v1/traces", "HTTPS://otel.example.com/v1/traces",
                 "http://u:p@[::1]:4318/v1/traces"):
        assert config.load(environ={"SHMSERVE__TRACING__OTLP_ENDPOINT": good}
                           ).tracing.otlp_endpoint == good
