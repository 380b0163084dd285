"""`shmserve status` (and `ctl`) from the command line: not running, watching, nginx silent
or frozen, an apply stopped part way, processes a dead supervisord left."""

from __future__ import annotations

import json
import os
import subprocess
import time

from shmserve import cli, config, processes, remote, render, status_cli, topology
from shmserve import status as statusview
from tests.unit.test_render import free_port, wait_until


def test_status_when_not_running_exits_3(deployment, capsys):
    assert cli.main(["status"]) == 3
    assert str(deployment.run_dir) in capsys.readouterr().out
    # --json says so in JSON too (it printed the plain line: an outside check)
    assert cli.main(["status", "--json"]) == 3
    said = json.loads(capsys.readouterr().out)
    assert said["state"] == "not_running" and said["run_dir"] == str(deployment.run_dir)
    assert str(deployment.run_dir) in said["state_text"]


def test_status_count_needs_watch(deployment, capsys):
    assert cli.main(["status", "--count", "2"]) == 2
    assert "--count counts --watch's refreshes" in capsys.readouterr().err


def test_ctl_when_not_running_says_so_as_status_does(deployment, capsys):
    # supervisorctl said "unix:///.../supervisor.sock no such file" and exited 4
    assert cli.main(["ctl", "status"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("shmserve: not running") and str(deployment.run_dir) in err


def test_status_watch_says_not_running_when_the_deployment_stops(deployment, capsys,
                                                                 monkeypatch):
    # After `down` in another shell, --watch printed empty tables and "no answer through nginx"
    # for ever (an outside check). Here supervisord "runs" for the first two samples.
    alive = iter([4242, 4242, 4242, None])
    monkeypatch.setattr(status_cli, "supervisord_pid", lambda cfg: next(alive))
    monkeypatch.setattr(status_cli, "process_info", lambda cfg: [])
    monkeypatch.setattr(statusview, "take", lambda url, http, infos, *more: statusview.Sample(
        time.monotonic(), infos(), None, {}))
    monkeypatch.setattr(time, "sleep", lambda s: None)
    assert cli.main(["status", "--watch", "0.1", "--count", "5"]) == 3
    out = capsys.readouterr().out
    assert "no answer through nginx" in out and out.rstrip().endswith(
        processes.not_running(deployment))


def test_status_waits_longer_than_nginx_takes_to_pass_over_a_frozen_frontend(
        deployment, capsys, monkeypatch):
    """With one frontend stopped (SIGSTOP), nginx answers /ready from the next one after
    nginx.probe_timeout_s; status gave up at the same 2 s and said nginx did not answer."""
    waits = []

    def http(url, method="GET", data=None, timeout=2.0, headers=None, context=None):
        waits.append(timeout)
        return None, b""
    monkeypatch.setattr(status_cli, "supervisord_pid", lambda cfg: 4242)
    monkeypatch.setattr(status_cli, "process_info", lambda cfg: [])
    monkeypatch.setattr(remote, "http", http)
    cli.main(["status"])
    assert waits and waits[0] > deployment.nginx.probe_timeout_s + 1
    # Not answered in that time, nginx is stuck, not passing over a frontend: the rate's second
    # sample waits short (each sample cost the whole wait: ~18 s for one status, an outside
    # check), and /metrics is not asked of it after /ready went unanswered.
    assert waits[1:] == [0.5], waits


def test_status_watch_waits_long_again_once_nginx_answers(deployment, capsys, monkeypatch):
    answers = iter([(None, b""), (200, b"{}"), (200, b""), (None, b"")])
    waits = []

    def http(url, method="GET", data=None, timeout=2.0, headers=None, context=None):
        waits.append((url.rpartition("/")[2], timeout))
        return next(answers, (None, b""))
    monkeypatch.setattr(status_cli, "supervisord_pid", lambda cfg: 4242)
    monkeypatch.setattr(status_cli, "process_info", lambda cfg: [])
    monkeypatch.setattr(remote, "http", http)
    monkeypatch.setattr(time, "sleep", lambda s: None)
    cli.main(["status", "--watch", "0.1", "--count", "3"])
    long = waits[0][1]
    assert waits[:4] == [("ready", long), ("ready", 0.5), ("metrics", 0.5), ("ready", long)]
    # past nginx's wait for a frozen frontend's /metrics (twice nginx.probe_timeout_s: a
    # status read nginx as not answering, then waited on that frontend itself, an outside check)
    rendered = f"proxy_read_timeout {render.metrics_timeout_s(deployment.nginx)}s"
    assert rendered in render.render_nginx(deployment) and \
        long > 2 * deployment.nginx.probe_timeout_s


def test_status_says_an_apply_stopped_part_way(deployment, capsys, monkeypatch):
    """After an apply stopped part way, run/config.json is the config it was applying: status
    showed its port and programs as if applied (an outside check), and now says so."""
    monkeypatch.setattr(status_cli, "supervisord_pid", lambda cfg: 4242)
    monkeypatch.setattr(status_cli, "process_info", lambda cfg: [])
    monkeypatch.setattr(remote, "http", lambda *a, **k: (None, b""))
    deployment.run_dir.mkdir(parents=True, exist_ok=True)
    cli.main(["status"])
    assert "apply" not in capsys.readouterr().err
    topology.apply_marker_path(deployment).write_text("{}")
    cli.main(["status"])
    assert "warning: an apply stopped part way (run/apply.json, under server.run_dir)" in \
        capsys.readouterr().err
    cli.main(["status", "--json"])
    said = capsys.readouterr()
    assert json.loads(said.out)["apply"] == "stopped_part_way" and not said.err


def test_status_names_what_a_dead_supervisord_left_running(deployment, capsys, monkeypatch):
    started = config.load()  # as `up` rendered it, on a port this shell no longer names
    render.render(started)
    monkeypatch.setenv("SHMSERVE__SERVER__PORT", str(free_port()))
    env = {**os.environ, "SHMSERVE_RUN_DIR": str(deployment.run_dir)}  # as supervisord sets
    left = subprocess.Popen(["sleep", "300"], env=env)
    try:
        wait_until(lambda: left.pid in processes.orphans(deployment))
        assert cli.main(["status"]) == 1
        out = capsys.readouterr().out
        assert "supervisord is not running" in out and str(left.pid) in out
        assert f"serving on 127.0.0.1:{started.server.port}:" in out
        assert "`shmserve down` stops them" in out
        assert cli.main(["status", "--json"]) == 1  # its url: where they serve, not this shell's
        said = json.loads(capsys.readouterr().out)
        assert said["url"] == f"http://127.0.0.1:{started.server.port}", said
        # supervisorctl's own answer would be "unix://... no such file": `ctl` says the same
        assert cli.main(["ctl", "status"]) == 1
        err = capsys.readouterr().err
        assert "supervisord is not running" in err and str(left.pid) in err, err
    finally:
        left.kill()
        left.wait()
    assert cli.main(["status"]) == 3
    assert cli.main(["ctl", "status"]) == 3 and "not running" in capsys.readouterr().err
