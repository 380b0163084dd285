"""Environment overrides of the config (SHMSERVE__SECTION__KEY): how a variable's text becomes
a value, a whole section in one variable, and a misspelled name pointed at what was meant."""

import dataclasses
import json

import pytest

from shmserve import config, layers
from shmserve.config import ConfigError


def test_a_number_from_the_environment_keeps_its_text_for_a_string_key():
    # YAML reads 01 as the integer 1: a revision label "01" became "1".
    cfg = config.load(environ={"SHMSERVE__MODELS__0__REVISION": "01",
                               "SHMSERVE__FRONTENDS__COUNT": "3",
                               "SHMSERVE__BATCHING__MAX_WAIT_MS": "2.50"})
    assert cfg.models[0].revision == "01"
    assert type(cfg.frontends.count) is int and cfg.frontends.count == 3
    assert type(cfg.batching.max_wait_ms) is float and cfg.batching.max_wait_ms == 2.5
    assert json.loads(cfg.to_json())["frontends"]["count"] == 3


def test_a_yes_or_no_from_the_environment_is_a_word_for_a_string_key_and_a_bool_for_a_bool():
    # YAML reads yes, no, on and off as booleans: a string key refused them as "not a string".
    cfg = config.load(environ={"SHMSERVE__MODELS__0__REVISION": "yes",
                               "SHMSERVE__TRACING__SERVICE_NAME": " Off ",
                               "SHMSERVE__WORKERS__REFUSE_PAST_DEADLINE": "no",
                               "SHMSERVE__WORKERS__CPU_FALLBACK": "On",
                               "SHMSERVE__MODELS__0__NORMALIZE": "yes"})
    assert cfg.models[0].revision == "yes" and type(cfg.models[0].revision) is str
    assert cfg.tracing.service_name == "Off"
    assert cfg.workers.refuse_past_deadline is False and cfg.workers.cpu_fallback is True
    assert cfg.models[0].normalize == "true"  # a choice of "auto", "true", "false"
    assert json.loads(cfg.to_json())["models"][0]["revision"] == "yes"
    with pytest.raises(ConfigError, match="frontends.count: expected an integer, got 'yes'"):
        config.load(environ={"SHMSERVE__FRONTENDS__COUNT": "yes"})
    # ... and so does a list's item: aliases, API keys of digits
    cfg = config.load(environ={"SHMSERVE__MODELS__0__ALIASES": "[yes, 01, 2.50]",
                               "SHMSERVE__AUTH__API_KEYS": "[01234567, 12345678]",
                               "SHMSERVE__WORKERS__DEVICES": "[0, 1]"})
    assert cfg.models[0].aliases == ["yes", "01", "2.50"]
    assert cfg.auth.api_keys == ["01234567", "12345678"] and cfg.workers.devices == [0, 1]


def test_a_misspelled_override_is_warned_of_once(capsys, monkeypatch):
    monkeypatch.setattr(layers, "_warned", set())
    environ = {"SHMSERVE_FRONTENDS__COUNT": "3", "SHMSERVE_ENV": "test",
               "SHMSERVE_CONFIG": "", "SHMSERVE_API_KEY": "k", "SHMSERVE_RUN_DIR": "/x",
               "SHMSERVE_BENCH_TEXTS": "9", "shmserve__server__port": "9999",
               "shmserve_env": "prod", "SHMSERVE_CONFG": "/my.yaml",
               "SHMSERVE_BATCHING_MAX_WAIT_MS": "5", "SHMSERVE_OTHER": "1"}
    cfg = config.load(environ=environ)
    config.load(environ=environ)
    assert cfg.frontends.count != 3 and cfg.server.port != 9999
    err = capsys.readouterr().err
    assert err.count("warning") == 6, err
    assert "SHMSERVE_FRONTENDS__COUNT is not read" in err and "SHMSERVE__FRONTENDS__COUNT?" in err
    assert "shmserve__server__port is not read" in err and "SHMSERVE__SERVER__PORT?" in err
    # single-underscore names nothing reads (a misspelled SHMSERVE_CONFIG started the server
    # without the user's file, without a word: an outside check)
    assert "shmserve_env is not read; SHMSERVE_ENV?" in err
    assert "SHMSERVE_CONFG is not read; SHMSERVE_CONFIG?" in err
    assert "SHMSERVE_BATCHING_MAX_WAIT_MS is not read; SHMSERVE__BATCHING__MAX_WAIT_MS?" in err
    assert "SHMSERVE_OTHER is not read; an override is SHMSERVE__SECTION__KEY" in err


@pytest.mark.parametrize("name, meant", [
    ("SHMSERVE_PORT", "SHMSERVE__SERVER__PORT"),  # not the benchmarks' SHMSERVE_PORTS
    ("SHMSERVE_RUNDIR", "SHMSERVE__SERVER__RUN_DIR"),  # not supervisord's SHMSERVE_RUN_DIR
    ("SHMSERVE_ENVIRONMENT", "SHMSERVE_ENV"), ("SHMSERVE_APIKEY", "SHMSERVE_API_KEY")])
def test_a_misspelled_name_is_pointed_at_what_a_user_sets(name, meant, capsys, monkeypatch):
    """The suggestions went to the test harness's and supervisord's names (an outside check)."""
    monkeypatch.setattr(layers, "_warned", set())
    config.load(environ={name: "1"})
    assert f"{name} is not read; {meant}?" in capsys.readouterr().err


def test_a_sections_mapping_in_a_variable_merges_into_the_files():
    """It replaced the section whole: with --env prod, SHMSERVE__FRONTENDS='{max_inflight:
    100}' took frontends.count back to base's 2 from prod's 4, and a bad value a file gave
    the section vanished (an outside check)."""
    cfg = config.load(env="prod", environ={"SHMSERVE__FRONTENDS": "{max_inflight: 100}",
                                           "SHMSERVE__SERVER__HOST": "127.0.0.1"})
    assert (cfg.frontends.count, cfg.frontends.max_inflight) == (4, 100)
    with pytest.raises(ConfigError, match=r"^SHMSERVE__: no key between"):
        config.load(environ={"SHMSERVE__": "{x: 1}"})
    with pytest.raises(ConfigError, match=r"^_admin: unknown key \(did you mean admin\?\) "
                                          r"\(set in SHMSERVE___ADMIN__TOKEN\)$"):
        config.load(environ={"SHMSERVE___ADMIN__TOKEN": "x"})


def test_a_list_items_mapping_in_a_variable_merges_into_the_item():
    """It replaced the item whole: SHMSERVE__MODELS__0='{dtype: fp32}' dropped the model's name
    and source, and the error named base.yaml (an outside check)."""
    cfg = config.load(environ={"SHMSERVE__MODELS__0": "{dtype: fp32}"})
    base = config.load(environ={})
    assert cfg.models[0].dtype == "fp32"
    assert dataclasses.replace(cfg.models[0], dtype=base.models[0].dtype) == base.models[0]
    with pytest.raises(ConfigError, match=r"^models\[0\]\.dtype: expected one of .* "
                                          r"\(set in SHMSERVE__MODELS__0\)$"):
        config.load(environ={"SHMSERVE__MODELS__0": "{dtype: fp33}"})
    with pytest.raises(ConfigError, match=r"^models\[0\]\.name: required "
                                          r"\(set in SHMSERVE__MODELS__0\)$"):
        config.load(environ={"SHMSERVE__MODELS__0": "{name: ~}"})  # the default: none


def test_two_variables_naming_one_key_are_refused():
    """SHMSERVE__frontends__count=4 beside SHMSERVE__FRONTENDS__COUNT=3 gave 4, the later in
    sort order, without a word (an outside check)."""
    with pytest.raises(ConfigError, match=r"^SHMSERVE__FRONTENDS__COUNT and "
                                          r"SHMSERVE__frontends__count: 2 variables set one "
                                          r"key \(frontends\.count\); keep one$"):
        config.load(environ={"SHMSERVE__FRONTENDS__COUNT": "3",
                             "SHMSERVE__frontends__count": "4"})


def test_a_string_key_from_the_environment_takes_the_whole_value(tmp_path):
    """YAML read the variables whole: a token's `#...` was a comment (SHMSERVE__ADMIN__TOKEN=
    'ab #cd' was "ab", '#abcdefgh' was "", admin off), '#key' in auth.api_keys was no key (an
    open server), e5's prompt 'query: ' a mapping, a date revision a date (outside checks)."""
    def load(**env):
        return config.load(environ={f"SHMSERVE__{k}": v for k, v in env.items()})

    assert load(ADMIN__TOKEN="abcdef #ghij").admin.token == "abcdef #ghij"
    for token in ("#abcdefgh", "&abcdefgh", "*abcdefgh", "%abcdefgh", "!abcdefgh"):
        assert load(ADMIN__TOKEN=token).admin.token == token
    assert load(TRACING__SERVICE_NAME="'spaced '").tracing.service_name == "spaced "  # quoted
    with pytest.raises(ConfigError, match="admin.token: expected 8 to 512 printable"):
        load(ADMIN__TOKEN="a")  # taken before (a security review)
    with pytest.raises(ConfigError, match="admin.token"):
        load(ADMIN__TOKEN="'spaced token '")  # no client could send its last space
    assert load(ADMIN__TOKEN="Null").admin.token == ""  # a null: the default, as documented
    assert load(MODELS__0__PROMPTS__QUERY="query: ").models[0].prompts == {"query": "query: "}
    assert load(MODELS__0__REVISION="2024-01-01").models[0].revision == "2024-01-01"
    with pytest.raises(ConfigError, match=r"auth.api_keys: its value \(not shown: a secret\) "
                       "reads as nothing"):
        load(AUTH__API_KEYS="#secretkey1")  # refused, not an empty list of keys
    with pytest.raises(ConfigError, match=r"frontends.count: '\*x' is not a YAML value"):
        load(FRONTENDS__COUNT="*x")
    assert load(WORKERS__DEVICES="[0, 2]").workers.devices == [0, 2]  # a list, not its text
    assert load(WORKERS__DEVICES="cpu").workers.devices == "cpu"


def test_an_environment_number_is_decimal():
    """YAML 1.1 read SHMSERVE__WORKERS__DEVICES='[010]' as GPU 8, and 1:00 as 60 (an outside
    check): only decimal integers are numbers; the others are refused for a number key and
    kept as text for a string key."""
    for value in ("1:00", "0b11", "0x1F"):
        with pytest.raises(ConfigError, match=f"frontends.count: expected an integer, got "
                                              f"'{value}'"):
            config.load(environ={"SHMSERVE__FRONTENDS__COUNT": value})
    # a leading zero says why ("got '010'" alone did not: an outside check)
    with pytest.raises(ConfigError, match=r"^frontends.count: expected an integer, got the text "
                                          r"'010' \(a leading zero: YAML 1.1 reads 010 as octal"):
        config.load(environ={"SHMSERVE__FRONTENDS__COUNT": "010"})
    assert config.load(environ={"SHMSERVE__FRONTENDS__COUNT": "+4"}).frontends.count == 4
    assert config.load(environ={"SHMSERVE__MODELS__0__REVISION": "010"}).models[0].revision \
        == "010"
    with pytest.raises(ConfigError, match="workers.devices"):
        config.load(environ={"SHMSERVE__WORKERS__DEVICES": "[010]"})


def test_an_empty_config_file_is_warned_of_once_and_a_missing_one_named_by_its_variable(
        tmp_path, capsys, monkeypatch):
    # a truncated or emptied file gave the defaults without a word; SHMSERVE_CONFIG's file
    # not found did not say where its name came from (an outside check)
    monkeypatch.setattr(layers, "_warned", set())
    empty = tmp_path / "prod.yaml"
    empty.write_text("# everything below was lost\n")
    for _ in range(2):
        assert config.load(extra=str(empty), environ={}).frontends.count == 2
    assert capsys.readouterr().err.count(f"config file {empty} holds no keys") == 1
    missing = str(tmp_path / "gone.yaml")
    with pytest.raises(ConfigError, match=r"config file not found: .*gone.yaml "
                                          r"\(SHMSERVE_CONFIG\)$"):
        config.load(environ={"SHMSERVE_CONFIG": missing})
    with pytest.raises(ConfigError, match=r"gone.yaml$"):  # --config: the user typed it
        config.load(extra=missing, environ={})
