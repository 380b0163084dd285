"""`shmserve restart` without a running stack: its targets, the gaps it warns of, what it says
differs from the running config, and a progress reader that leaves."""

from __future__ import annotations

import argparse
import json
import os
import time

import pytest

from shmserve import config, layers, remote, render, restarts, topology
from tests.unit.test_render import free_port


@pytest.mark.parametrize("name,target", [
    ("frontends", "frontends:*"), ("workers", "workers:*"), ("nginx", "nginx"),
    ("frontend-1", "frontends:frontend-1"), ("worker-0", "workers:worker-0"),
    ("workers:worker-2", "workers:worker-2")])
def test_restart_targets(name, target):
    assert restarts.restart_target(name) == target


@pytest.mark.parametrize("group,name,programs,all_at_once,gap", [
    ("workers", "*", ["worker-0", "worker-1"], False, None),
    ("workers", "worker-1", ["worker-0", "worker-1"], False, None),
    ("frontends", "*", ["frontend-0", "frontend-1"], False, None),
    ("workers", "*", ["worker-0"], False, "worker-0 is the only program in workers: requests "
     "wait for a worker (frontends.no_worker_wait_s) and are answered 503"),
    ("frontends", "frontend-0", ["frontend-0"], False, "frontend-0 is the only program in "
     "frontends: nginx answers 502"),
    ("workers", "*", ["worker-0", "worker-1"], True, "workers restart all at once"),
    ("workers", "worker-0", ["worker-0", "worker-1"], True, None),
    ("nginx", "", ["nginx"], False, None),
])
def test_a_restart_that_leaves_a_gap_says_so(group, name, programs, all_at_once, gap):
    warning = restarts.restart_gap(group, name, programs, all_at_once)
    assert (warning is None) if gap is None else warning.startswith(gap)


def test_a_gap_left_by_a_stopped_sibling_is_said_as_such():
    """It said "worker-1 is the only program in workers" with worker-0 stopped by a command."""
    warning = restarts.restart_gap("workers", "*", ["worker-1"], False, stopped=["worker-0"])
    assert warning.startswith("worker-1 is the only program of workers running (worker-0 "
                              "stopped): requests wait for a worker"), warning


def test_a_rolling_worker_restart_names_the_models_only_one_worker_loads():
    cfg = config.from_tree({
        "workers": {"devices": "cpu", "cpu_workers": 3},
        "models": [{"name": "everywhere", "source": "x"},
                   {"name": "clf", "source": "y", "devices": [0]},
                   {"name": "two", "source": "y", "devices": [1, 2]},
                   {"name": "ab", "variants": [{"name": "a", "source": "x"},
                                               {"name": "b", "source": "y"}], "devices": [2]}]})
    programs = ["worker-0", "worker-1", "worker-2"]
    lone = restarts.lone_models(cfg, programs)
    assert lone == {"worker-0": ["clf"], "worker-2": ["ab@a", "ab@b"]}
    assert restarts.lone_models(cfg, ["worker-1"]) == {}
    warning = restarts.restart_gap("workers", "*", programs, False, lone)
    assert warning.startswith("some models have no other worker (clf only on worker-0; "
                              "ab@a, ab@b only on worker-2): while their worker restarts, "
                              "requests for them wait for a worker")
    assert "models[].devices" in warning
    assert restarts.restart_gap("workers", "worker-1", programs, False, {}) is None


def test_restart_names_what_the_overrides_given_now_would_change(tmp_path):
    """Overrides given to `up` and not repeated are no difference (commands act on the
    deployment as started); overrides given now, and config files edited since, are."""
    at_up = {"SHMSERVE_ENV": "test", "SHMSERVE__SERVER__RUN_DIR": str(tmp_path / "run"),
             "SHMSERVE__SERVER__PORT": str(free_port()), "SHMSERVE__WORKERS__DEVICES": "cpu"}
    running = config.load(environ=at_up)
    render.render(running)
    topology.config_files_path(running).write_text(json.dumps(layers.digests(
        layers.file_layers(None, None, at_up))))  # as `up` writes it
    later = {"SHMSERVE_ENV": "test"}  # a later shell: the port and devices not repeated
    args = argparse.Namespace(env=None, config=None)
    assert restarts.config_drift(args, running, later) is None
    said = restarts.config_drift(args, running, {**later, "SHMSERVE__FRONTENDS__COUNT": "7"})
    assert f"frontends.count: {running.frontends.count} -> 7" in said
    assert "server.port" not in said and "`shmserve apply`" in said
    extra = tmp_path / "extra.yaml"
    extra.write_text("batching:\n  max_wait_ms: 9\n")
    said = restarts.config_drift(argparse.Namespace(env=None, config=str(extra)), running, later)
    assert "batching.max_wait_ms" in said
    assert ("Config files the running config was not read from (at `up`, or the last apply): "
            f"{extra.resolve()}") in said
    assert "invalid" in restarts.config_drift(
        args, running, {**later, "SHMSERVE__FRONTENDS__COUNT": "0"})


def test_restart_names_the_files_up_read_that_were_edited_since(tmp_path):
    """`up` keeps a digest of every config file it read: the --config file edited later is
    named even when not given again (it was not, an outside check), and a file rewritten with
    the same content (a checkout) is no edit (it was, by its time)."""
    mine = tmp_path / "my.yaml"
    mine.write_text("batching:\n  max_wait_ms: 3\n")
    at_up = {"SHMSERVE_ENV": "test", "SHMSERVE__SERVER__RUN_DIR": str(tmp_path / "run"),
             "SHMSERVE__SERVER__PORT": str(free_port()), "SHMSERVE__WORKERS__DEVICES": "cpu"}
    running = config.load(extra=mine, environ=at_up)
    render.render(running)
    topology.config_files_path(running).write_text(json.dumps(layers.digests(
        layers.file_layers(None, mine, at_up))))  # as `up` writes it
    later = {"SHMSERVE_ENV": "test"}
    args = argparse.Namespace(env=None, config=None)
    mine.write_text(mine.read_text())  # rewritten, same bytes, a later time
    assert restarts.config_drift(args, running, later) is None
    mine.write_text("batching:\n  max_wait_ms: 3\nfrontends: {count: 3}\n")
    said = restarts.config_drift(args, running, later)
    assert ("Config files edited or removed since `up` (or the last apply) read them: "
            f"{mine.resolve()}") in said
    assert said.endswith("`apply --dry-run` lists the keys that differ)"), said
    other = tmp_path / "other.yaml"
    other.write_text("{}\n")
    said = restarts.config_drift(argparse.Namespace(env=None, config=str(other)), running,
                                 later)
    assert ("Config files the running config was not read from (at `up`, or the last apply): "
            f"{other.resolve()}") in said


def test_a_bare_restart_after_up_with_another_env_is_no_change(tmp_path):
    """`up --env prod`, then `restart frontends` with no env named: it warned that
    configs/dev.yaml, the default env's file, was new to the deployment (an outside check).
    Naming another env than `up`'s is still a change."""
    at_up = {"SHMSERVE__SERVER__RUN_DIR": str(tmp_path / "run"),
             "SHMSERVE__SERVER__PORT": str(free_port()), "SHMSERVE__WORKERS__DEVICES": "cpu"}
    running = config.load(env="prod", environ=at_up)
    render.render(running)
    topology.config_files_path(running).write_text(json.dumps(layers.digests(
        layers.file_layers("prod", None, at_up))))  # as `up --env prod` writes it
    assert restarts.config_drift(argparse.Namespace(env=None, config=None), running, {}) is None
    assert restarts.config_drift(argparse.Namespace(env="prod", config=None), running,
                                 {}) is None
    said = restarts.config_drift(argparse.Namespace(env="dev", config=None), running, {})
    assert "was not read from (at `up`, or the last apply)" in said and "dev.yaml" in said


def test_restart_progress_to_a_reader_that_left_does_not_stop_the_restart(tmp_path):
    """`restart workers 2>&1 | head -1`: the second line raised BrokenPipeError and the
    rolling restart stopped half way (an outside check)."""
    read, write = os.pipe()
    os.close(read)  # the reader left
    with os.fdopen(write, "w") as stream:
        restarts.say("shmserve: restarted worker-0", stream)  # no exception
        restarts.say("shmserve: worker-0 ready", stream)  # written to /dev/null now


@pytest.mark.parametrize("target", ["frontend-2", "frontends", "worker-1", "workers"])
def test_restart_refuses_programs_the_running_config_no_longer_has(monkeypatch, tmp_path, target):
    """After an apply that shrinks a group stopped part way (or while it runs), supervisord
    still runs programs run/config.json no longer has: restarting them raised IndexError after
    the restart (an outside check). Refused, naming them, before anything restarts."""
    from shmserve import apply, cli

    cfg = config.from_tree({"server": {"run_dir": str(tmp_path / "run"), "port": free_port()},
                            "workers": {"devices": "cpu", "cpu_workers": 1},
                            "frontends": {"count": 2}, "models": [{"name": "m", "source": "x"}]})
    infos = [{"name": f"frontend-{i}", "group": "frontends", "pid": 100 + i} for i in range(3)]
    infos += [{"name": f"worker-{i}", "group": "workers", "pid": 200 + i} for i in range(2)]
    monkeypatch.setattr(restarts.processes, "deployment", lambda args: cfg)
    monkeypatch.setattr(restarts.processes, "supervisord_pid", lambda cfg: 1)
    monkeypatch.setattr(apply, "running_now", lambda cfg: True)
    monkeypatch.setattr(restarts, "process_info", lambda cfg: infos)
    ran = []
    monkeypatch.setattr(restarts, "ctl", lambda *argv: ran.append(argv), raising=False)
    monkeypatch.setattr(restarts.subprocess, "run", lambda *a, **k: ran.append(a))
    args = argparse.Namespace(target=target, timeout=None, all_at_once=False)
    with pytest.raises(cli.CliError, match=r"(frontend-2|worker-1) runs? but the running config "
                       r"\(run/config.json\) has (2 frontends|1 worker).*`shmserve apply`"):
        restarts.restart(args)
    assert not ran


def test_a_worker_restart_waits_for_another_worker_still_loading(monkeypatch, capsys):
    """`supervisorctl restart workers:worker-1` then at once `shmserve restart worker-0`: worker-0
    stopped while worker-1 loaded, and a request found no ready worker (an outside check)."""
    cfg = config.from_tree({"models": [{"name": "a", "source": "/nonexistent/a"}],
                            "workers": {"devices": "cpu", "cpu_workers": 2}})
    answers = iter([False, False, True])  # worker-1 ready at the third look

    def get_unix(path, target, timeout=2.0):
        ready = next(answers)
        return 200, json.dumps({"workers": [
            {"worker": 0, "alive": True, "ready": True, "pid": 10},
            {"worker": 1, "alive": True, "ready": ready, "pid": 11}]}).encode()
    monkeypatch.setattr(remote, "get_unix", get_unix)
    monkeypatch.setattr(restarts.time, "sleep", lambda s: None)
    states = {"worker-1": "RUNNING"}
    monkeypatch.setattr(restarts, "process_info", lambda cfg: [
        {"name": "worker-0", "group": "workers", "statename": "RUNNING", "pid": 10},
        {"name": "worker-1", "group": "workers", "statename": states["worker-1"], "pid": 11},
        {"name": "frontend-0", "group": "frontends", "statename": "RUNNING", "pid": 12}])
    restarts.wait_for_others(cfg, 0, timeout=30)
    assert "worker-1 is loading: waiting until ready before restarting worker-0" in \
        capsys.readouterr().out
    with pytest.raises(StopIteration):
        next(answers)  # looked until it was ready
    # Still importing (its first heartbeat not yet heard: the frontends name the old pid)
    monkeypatch.setattr(remote, "get_unix", lambda *a, **k: (200, json.dumps(
        {"workers": [{"worker": 0, "alive": True, "ready": False, "pid": 10},
                     {"worker": 1, "alive": False, "ready": True, "pid": 9}]}).encode()))
    assert restarts.loading_workers(cfg, 0) == [1]
    states["worker-1"] = "BACKOFF"  # exited: not waited for; nor is the one restarted
    assert restarts.loading_workers(cfg, 0) == []


def test_a_failing_ready_is_told_by_the_models_and_workers_it_names():
    """restart's warning names what loads nowhere (it said "a model", an outside check)."""
    from shmserve.probes import failing_models

    answer = {"status": "failing", "workers": [
        {"worker": 0, "ready": True, "load_error": None, "unloaded": []},
        {"worker": 1, "ready": True, "load_error": None,
         "unloaded": [{"model": "broken", "error": "ValueError: shape"}]},
        {"worker": 2, "ready": False, "load_error": "OSError: no model.safetensors",
         "unloaded": []}]}
    assert failing_models(answer) == ("broken (worker 1); worker 2: OSError: no "
                                      "model.safetensors")


def test_a_restarted_worker_that_fails_its_start_ends_the_wait_at_once(monkeypatch, capsys,
                                                                      tmp_path):
    """`restart worker-0` of a worker whose models cannot load waited for its third start, the
    back-off growing between them (24 s in an e2e test): the frontends name the failed
    process, and the restarted one's failure is said at once; the process before it is not."""
    cfg = config.from_tree({"models": [{"name": "a", "source": "/nonexistent/a"}],
                            "server": {"run_dir": str(tmp_path / "run")},
                            "workers": {"devices": "cpu", "cpu_workers": 1}})
    failed_pid = [7]

    def get_unix(path, target, timeout=2.0):
        return 503, json.dumps({"status": "failing", "workers": [
            {"worker": 0, "alive": True, "ready": False, "pid": 8, "failed_loads": 2,
             "load_error": "ModelSourceError: no model.safetensors",
             "failed_pid": failed_pid[0]}]}).encode()
    monkeypatch.setattr(remote, "get_unix", get_unix)
    monkeypatch.setattr(restarts.processes, "supervisord_pid", lambda cfg: 1)
    monkeypatch.setattr(restarts, "process_info", lambda cfg: [
        {"name": "worker-0", "group": "workers", "statename": "RUNNING", "pid": 8}])
    # the old process's failure (pid 7) is not the restarted one's (pid 8): it waits on
    with pytest.raises(restarts.CliError, match="worker-0 not ready"):
        restarts.wait_until_ready(cfg, "workers", "worker-0", 8, timeout=0.5, rest="")
    failed_pid[0] = 8
    started = time.monotonic()
    with pytest.raises(restarts.CliError) as refused:
        restarts.wait_until_ready(cfg, "workers", "worker-0", 8, timeout=30, rest="; and so on")
    assert time.monotonic() - started < 5
    assert str(refused.value).startswith(
        "worker-0 exits before it is ready (pid 8 failed; supervisord starts it again, later "
        "each time): ModelSourceError: no model.safetensors; fix what the end of ")
    assert str(refused.value).endswith("; and so on")
