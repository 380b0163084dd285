"""`shmserve apply` run against a faked supervisord (apply._apply, apply.replace): the record it
keeps while it runs (run/apply.json), and an apply that goes on from one stopped part way."""

from __future__ import annotations

import pytest

from shmserve import apply
from tests.unit.test_apply import with_


def fake_supervisor(cfg, frontends: int | None = None):
    """What `apply` asks supervisord over XML-RPC: its API, and the programs it runs."""
    names = [("workers", f"worker-{i}") for i in range(cfg.workers.cpu_workers)] + [
        ("frontends", f"frontend-{i}") for i in range(frontends or cfg.frontends.count)] + [
        ("nginx", "nginx")]
    programs = [{"group": group, "name": name} for group, name in names]
    return type("Proxy", (), {"shmserve": type("Api", (), {"getAPIVersion": lambda: 1}),
                              "supervisor": type("Sup", (), {
                                  "getAllProcessInfo": lambda: programs})})


def running(base, monkeypatch, frontends: int | None = None) -> None:
    """`base` as if a deployment ran it, for `apply._apply`: supervisord's answers faked
    (`frontends` running), the checks that read the machine passed."""
    import contextlib

    base.run_dir.mkdir(parents=True, exist_ok=True)
    (base.run_dir / "nginx").mkdir(exist_ok=True)
    proxy = fake_supervisor(base, frontends)
    monkeypatch.setattr(apply.processes, "running_config", lambda cfg: base)
    monkeypatch.setattr(apply.processes, "supervisor", lambda cfg: contextlib.nullcontext(proxy))
    monkeypatch.setattr(apply.models, "check", lambda *a: None)
    monkeypatch.setattr(apply, "check_shm", lambda cfg: None)
    monkeypatch.setattr(apply.versions, "protocol_change", lambda cfg: None)


def replacing_steps(base, monkeypatch, infos: list[dict]) -> list[tuple[str, str]]:
    """`apply.replace`'s steps against a faked supervisord where every program is STOPPED
    (`infos`: its getAllProcessInfo), recorded into the list returned as they happen."""
    import contextlib

    running(base, monkeypatch)
    did: list[tuple[str, str]] = []
    proxy = type("Proxy", (), {"supervisor": type("Sup", (), {
        "startProcess": staticmethod(lambda name, wait: did.append(("start", name)))})})
    monkeypatch.setattr(apply.processes, "supervisor", lambda cfg: contextlib.nullcontext(proxy))
    monkeypatch.setattr(apply, "state_of", lambda cfg, program: "STOPPED")
    monkeypatch.setattr(apply, "process_info", lambda cfg: infos)
    monkeypatch.setattr(apply, "ctl", lambda cfg, *args: did.append(("stop", args[1])))
    monkeypatch.setattr(apply, "sync", lambda cfg, group, program: did.append(("sync", program)))
    monkeypatch.setattr(apply, "pid_of", lambda cfg, program: 1)
    monkeypatch.setattr(apply, "wait_until_ready",
                        lambda cfg, group, program, *a, **k: did.append(("ready", program)))
    return did


def test_an_apply_nginx_refuses_leaves_no_apply_under_way(base, monkeypatch):
    """render refuses the new config (nginx -t) before it replaces a file: the apply marker
    written just before goes too, or an earlier apply's is put back as it was, so `status`
    does not report an apply stopped part way and the next apply does not resume one."""
    import argparse
    import json

    from shmserve import render

    running(base, monkeypatch)
    render.nginx_conf(base).write_text("# the running one\n")

    def refused(cfg):
        raise render.RenderError("nginx rejects the config rendered for it")

    monkeypatch.setattr(apply.render, "render", refused)
    new = with_(base, batching={"max_wait_ms": 3})
    args = argparse.Namespace(dry_run=False, timeout=None, env=None, config=None, move=False)
    marker = apply.topology.apply_marker_path(base)
    with pytest.raises(render.RenderError):
        apply._apply(args, new)
    assert not marker.exists()
    earlier = json.dumps({"from": json.loads(base.to_json()), "attempts": []}) + "\n"
    marker.write_text(earlier)
    with pytest.raises(render.RenderError):
        apply._apply(args, new)
    assert marker.read_text() == earlier


def test_a_stopped_program_is_left_so_unless_the_apply_it_goes_on_from_stopped_it(
        base, monkeypatch):
    """A program stopped by a command stays stopped through an apply (made as the new config
    says, not started); one that an apply killed between its stop and its start left stopped
    (its record, run/restart.json, as a restart's) is started by the apply that goes on, which
    leaves the record where the command killed left it."""
    import json
    import time

    from shmserve import render, restart_record

    earlier = int(time.time()) - 60
    did = replacing_steps(base, monkeypatch, [
        {"group": "workers", "name": f"worker-{i}", "statename": "STOPPED", "start": earlier}
        for i in (0, 1)])
    record = apply.topology.restart_marker_path(base)
    restart_record.begin(base, ["workers:worker-1"], "apply")  # the killed apply's
    apply.replace(base, "workers", "worker-0", 5)  # an operator's stop: left stopped
    assert did == [("sync", "worker-0")]
    did.clear()
    apply.replace(base, "workers", "worker-1", 5)  # the killed apply's own
    assert did == [("stop", "workers:worker-1"), ("sync", "worker-1"),
                   ("start", "workers:worker-1"), ("ready", "worker-1")]
    assert not record.exists()  # started: no longer stopped by anyone's command
    assert restart_record.said(base, ["worker-1"]).startswith("worker-1 was stopped by a ")

    # The apply that goes on leaves the record as it found it (read at render, here refused
    # so that nothing runs): the program is started when its step comes
    running(base, monkeypatch)
    render.nginx_conf(base).write_text("# the running one\n")
    marker = apply.topology.apply_marker_path(base)
    marker.write_text(json.dumps({"from": json.loads(base.to_json()), "attempts": []}))
    restart_record.begin(base, ["workers:worker-1"], "apply")
    assert "stopped by an apply that did not finish" in restart_record.said(base, ["worker-1"])
    seen = []

    def refused(cfg):
        seen.append(json.loads(record.read_text()).get("programs"))
        raise render.RenderError("stop here")

    monkeypatch.setattr(apply.render, "render", refused)
    args = type("Args", (), {"dry_run": False, "timeout": None, "env": None, "config": None,
                             "move": False})
    with pytest.raises(render.RenderError):
        apply._apply(args, with_(base, batching={"max_wait_ms": 3}))
    assert seen == [["workers:worker-1"]]


def test_a_program_a_killed_restart_left_stopped_is_started_by_an_apply(base, monkeypatch):
    """A `shmserve restart` killed between its stop and its start (shmserve.restart_record)
    left its program stopped: an apply that restarts the group starts it, as the restart would
    have (it was taken for an operator's stop and left so); an operator's stop is still kept."""
    import time

    from shmserve import restart_record

    earlier = int(time.time()) - 60
    did = replacing_steps(base, monkeypatch, [
        {"group": "workers", "name": f"worker-{i}", "statename": "STOPPED", "start": earlier}
        for i in (0, 1)])
    restart_record.begin(base, ["workers:worker-1"])
    apply.replace(base, "workers", "worker-0", 5)  # an operator's stop: left stopped
    assert did == [("sync", "worker-0")]
    did.clear()
    apply.replace(base, "workers", "worker-1", 5)
    assert did == [("stop", "workers:worker-1"), ("sync", "worker-1"),
                   ("start", "workers:worker-1"), ("ready", "worker-1")]


def test_a_dry_run_after_an_apply_that_stopped_part_way_lists_the_keys(base, monkeypatch,
                                                                        capsys):
    """It printed "the config from before the earlier apply" where the README says a dry run
    lists every changed key (an outside check): the keys from the config before it, and those
    the earlier apply's restarted programs run, put back."""
    import argparse
    import json

    from shmserve import render

    running(base, monkeypatch)
    render.nginx_conf(base).write_text(render.render_nginx(base))
    tried = with_(base, batching={"max_wait_ms": 9.0})
    apply.topology.apply_marker_path(base).write_text(json.dumps(
        {"from": json.loads(base.to_json()), "attempts": [json.loads(tried.to_json())]}))
    args = argparse.Namespace(dry_run=True, timeout=None, env=None, config=None, move=False)
    for new, keys in (
            (base, ["batching.max_wait_ms: 9.0 -> 2.0 (the earlier apply's, on the programs "
                    "it restarted)"]),  # the config put back
            (with_(base, limits={"max_texts_per_request": 8}),
             ["limits.max_texts_per_request: 2048 -> 8",
              "batching.max_wait_ms: 9.0 -> 2.0 (the earlier apply's, on the programs it "
              "restarted)"]),
            (tried, ["batching.max_wait_ms: 2.0 -> 9.0"])):  # applied again
        assert apply._apply(args, new) == 0
        out = capsys.readouterr().out
        listed = out.split("would apply (finishing the earlier apply):\n")[1].split(
            "\nshmserve:")[0]
        assert listed.splitlines() == [f"  {key}" for key in keys], out
    # The earlier apply had started a third frontend: its dry run listed no stop of it, which
    # the apply then did, alone (an outside check)
    running(base, monkeypatch, frontends=3)
    assert apply._apply(args, base) == 0
    steps = capsys.readouterr().out.split("shmserve: steps")[1]
    assert "frontend-2" in steps and "stop" in steps, steps


def test_a_program_an_apply_has_not_reached_starts_on_the_config_it_ran(base):
    """supervisord starts a crashed program at once, on run/config.json: during an apply that
    is the new config, out of the apply's order (an outside check: a frontend killed while the
    workers still served a model's old units answered it 503). A program the apply (or an
    earlier one it goes on from) has reached starts on that apply's config; one it has not, on
    the config from before; one it adds (not in that config) on config.json."""
    import json

    from shmserve import program_config, restart_record, topology

    first, new = with_(base, frontends={"count": 3}), with_(base, frontends={"count": 4})
    path = topology.resolved_config_path(base)
    base.run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(new.to_json())
    marker = topology.apply_marker_path(base)

    def count(program):
        cfg, why = program_config.load(path, program)
        return cfg.frontends.count, bool(why)
    assert count("frontend-0") == (4, False)  # no apply under way
    marker.write_text(json.dumps({"from": json.loads(base.to_json()), "attempts": [
        json.loads(first.to_json()), json.loads(new.to_json())], "reached": {"frontend-1": 0}}))
    assert count("frontend-0") == (2, True)  # not reached: the config from before
    assert count("worker-1") == (2, True)
    assert count("frontend-1") == (3, True)  # reached by the earlier apply: its config
    assert count("frontend-3") == (4, False)  # added: only the new config has it
    program_config.mark_reached(base, ["frontends:frontend-0"])  # as apply and restart do
    restart_record.begin(base, ["workers:worker-1"])
    assert count("frontend-0") == (4, False) and count("worker-1") == (4, False)
    assert json.loads(marker.read_text())["reached"] == {
        "frontend-1": 0, "frontend-0": 1, "worker-1": 1}
    marker.write_text("{not json")  # a record this cannot read: config.json, as before
    assert count("frontend-0") == (4, False)
    # ... or a config before it that cannot start now (its key file gone since): config.json
    keyed = with_(base, auth={"api_keys_file": str(base.run_dir / "gone-keys")})
    marker.write_text(json.dumps({"from": json.loads(keyed.to_json()),
                                  "attempts": [json.loads(new.to_json())]}))
    assert program_config.load(path, "frontend-0", read_keys=True)[0].frontends.count == 4
    assert count("frontend-0") == (2, True)  # a worker does not read the keys
    marker.unlink()
    program_config.mark_reached(base, ["frontend-0"])  # no apply: nothing written
    assert not marker.exists()
