"""`shmserve config` without a running stack: the resolved config as printed, credentials hidden
unless asked, which deployment a file or a running one selects, the models checked as `up`
checks them, a bad value named. (tests/unit/test_cli.py: the other commands.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from shmserve import cli, config, configview, processes, render
from shmserve.config import REPO_ROOT


def test_config_prints_the_resolved_config(deployment, capsys):
    assert cli.main(["config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["server"]["run_dir"] == str(deployment.run_dir)
    assert printed["workers"]["devices"] == "cpu" and printed["workers"]["cpu_workers"] == 2


def test_config_files_given_twice_merge_as_a_list_does(deployment, tmp_path, capsys):
    """What `shmserve config` prints of two --config files is what `a:b` gives."""
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("limits: {max_texts_per_request: 4}\nnginx: {gzip: true}\n")
    b.write_text("batching: {max_wait_ms: 3}\n")
    assert cli.main(["config", "--config", str(a), "--config", str(b)]) == 0
    twice = json.loads(capsys.readouterr().out)
    assert cli.main(["config", "--config", f"{a}:{b}"]) == 0
    assert json.loads(capsys.readouterr().out) == twice
    assert (twice["limits"]["max_texts_per_request"], twice["nginx"]["gzip"],
            twice["batching"]["max_wait_ms"]) == (4, True, 3.0)


def test_config_hides_credentials_unless_asked(deployment, monkeypatch, capsys):
    monkeypatch.setenv("SHMSERVE__ADMIN__TOKEN", "admin-secret-1234")
    monkeypatch.setenv("SHMSERVE__AUTH__API_KEYS", '["key-secret-1234", "key-secret-5678"]')
    # a collector's password in its URL, too (it was printed: an outside check)
    monkeypatch.setenv("SHMSERVE__TRACING__OTLP_ENDPOINT", "http://u:pw-secret@c:4318/v1/traces")
    assert cli.main(["config"]) == 0
    out = capsys.readouterr().out
    assert "secret" not in out
    printed = json.loads(out)
    assert printed["admin"]["token"] == "***" and printed["auth"]["api_keys"] == ["***"] * 2
    assert printed["tracing"]["otlp_endpoint"] == "http://***@c:4318/v1/traces"
    old, new = config.load(), config.load(environ={**os.environ,
                                                   "SHMSERVE__ADMIN__TOKEN": "other-1234"})
    assert configview.differences(old, new) == ["admin.token: changed"]
    assert cli.main(["config", "--show-secrets"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["admin"]["token"] == "admin-secret-1234"
    assert printed["auth"]["api_keys"] == ["key-secret-1234", "key-secret-5678"]


def test_an_extra_config_file_selects_the_deployment(deployment, tmp_path, capsys):
    extra = tmp_path / "extra.yaml"
    extra.write_text("frontends:\n  count: 5\n")
    assert cli.main(["config", "--config", str(extra)]) == 0
    assert json.loads(capsys.readouterr().out)["frontends"]["count"] == 5


def test_config_says_when_a_running_deployment_has_another_and_shows_it(deployment, monkeypatch,
                                                                         capsys):
    # While a deployment runs, `config` printed the config as the environment gives it now
    # (port 8080, say) with no word that the stack serves from another (an outside check).
    assert cli.main(["config", "--running"]) == 2
    assert "not running (run_dir " in capsys.readouterr().err
    started = config.load()
    render.render(started)  # what `up` writes: run/config.json
    monkeypatch.setattr(processes, "supervisord_pid", lambda cfg: 4242)  # as if it ran
    assert cli.main(["config"]) == 0
    assert "shmserve config --running" not in capsys.readouterr().err  # the same config
    monkeypatch.setenv("SHMSERVE__FRONTENDS__COUNT", "5")
    assert cli.main(["config"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["frontends"]["count"] == 5
    assert "a deployment runs from this run_dir with another config" in captured.err
    assert cli.main(["config", "--running"]) == 0
    assert json.loads(capsys.readouterr().out)["frontends"]["count"] == \
        started.frontends.count != 5


def test_config_checks_the_models_as_up_does(deployment, monkeypatch, capsys, tmp_path):
    # It checked the config's shape only: a pinned device no worker has, a source outside the
    # roots, passed `shmserve config` and were refused by `up`.
    monkeypatch.setenv("SHMSERVE__MODELS__0__DEVICES", "[5]")
    assert cli.main(["config"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["models"][0]["devices"] == [5]  # printed all the same
    assert "models[0].devices: [5] name no worker" in captured.err
    monkeypatch.delenv("SHMSERVE__MODELS__0__DEVICES")
    monkeypatch.setenv("SHMSERVE__MODELS__0__SOURCE", str(tmp_path))
    assert cli.main(["config"]) == 2
    assert "outside the model roots" in capsys.readouterr().err


def test_a_reader_that_leaves_early_gets_no_traceback(deployment):
    """`shmserve config | head`: the pipe's reader is gone before the config is written (it
    printed a BrokenPipeError traceback)."""
    proc = subprocess.Popen([sys.executable, "-m", "shmserve.cli", "config"], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # long before the child, still importing, writes
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and err == "", err


def test_a_bad_value_exits_2_naming_the_key(deployment, monkeypatch, capsys):
    monkeypatch.setenv("SHMSERVE__SERVER__PORT", "0")
    assert cli.main(["config"]) == 2
    assert "server.port" in capsys.readouterr().err
