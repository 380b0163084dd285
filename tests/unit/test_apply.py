"""What `shmserve apply` restarts for a change of config (shmserve.apply_plan.plan), and the key
lists it decides by, checked against the code of the processes they spare."""

from __future__ import annotations

import dataclasses
import re

import pytest

from shmserve import apply, apply_plan, apply_sources, config, moves
from shmserve.config import REPO_ROOT
from tests.unit.test_render import make_config

NONE = {"added": [], "removed": [], "changed": []}


def with_(cfg, **sections):
    return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **values)
                                       for name, values in sections.items()})


def test_a_worker_side_key_restarts_the_workers_only(base):
    steps = apply_plan.plan(base, with_(base, batching={"max_wait_ms": 5.0}), NONE)
    assert steps.roll_workers == ["worker-0", "worker-1"] and steps.roll_frontends == []


def test_a_frontend_side_key_restarts_the_frontends_only(base):
    for change in ({"limits": {"max_texts_per_request": 8}},
                   {"nginx": {"client_max_body_size": "2m"}}, {"auth": {"api_keys": ("k",)}}):
        steps = apply_plan.plan(base, with_(base, **change), NONE)
        assert steps.roll_workers == [] and steps.roll_frontends == ["frontend-0",
                                                                       "frontend-1"], change


def test_a_key_only_nginx_reads_restarts_nothing(base):
    """Rate limits, gzip, CORS: nginx reloads its configuration; no frontend restarts (an
    outside check saw both frontends restart for a rate limit)."""
    for change in ({"rate_limit_per_s": 5.0}, {"max_requests_per_client": 8}, {"gzip": True},
                   {"probe_timeout_s": 3.0}):
        steps = apply_plan.plan(base, with_(base, nginx=change), NONE)
        assert steps.roll_workers == [] == steps.roll_frontends, change
        assert steps.lines() == ["  no process restarts"]


def test_a_tls_file_changed_restarts_the_reaper_which_reads_its_dates(base):
    """The reaper reads the TLS files' dates for the alerts (its gauge kept the old file's)."""
    tls_on = with_(base, nginx={"tls_certificate": "/etc/a.pem", "tls_key": "/etc/a.key"})
    steps = apply_plan.plan(tls_on, with_(tls_on, nginx={"tls_certificate": "/etc/b.pem"}), NONE)
    assert steps.reaper and steps.roll_workers == [] == steps.roll_frontends
    assert not apply_plan.plan(base, with_(base, nginx={"gzip": True}), NONE).reaper


def test_a_config_put_back_after_a_failed_apply_restarts_what_that_apply_restarted(base):
    """The failed apply's restarted workers run its config: the same keys back are no
    difference from the config before it, but one from what they run."""
    tried = with_(base, batching={"max_wait_ms": 9.0})
    steps = apply_plan.plan(base, base, NONE, attempted=[tried])
    assert steps.roll_workers == ["worker-0", "worker-1"] and steps.roll_frontends == []
    # A worker the failed apply moved to another device: the dry run (pending from the counts
    # alone) restarts it too, as the run does from supervisord (it left it out)
    moved = with_(base, workers={"devices": [0, 1]})  # two GPUs, as an outside check tried
    steps = apply_plan.plan(base, base, apply_plan.by_counts(base, base), attempted=[moved])
    assert "worker-0" in steps.roll_workers, steps
    # nginx reloads when resumed only if what it may run differs (it always did: a reload for
    # the workers' change alone, and reloads cost requests on idle keep-alive connections)
    from shmserve import render

    on_disk = render.render_nginx(tried)
    assert not apply_plan.nginx_differs(base, [tried], base, on_disk)
    assert apply_plan.nginx_differs(base, [with_(base, frontends={"count": 3})], base,
                               render.render_nginx(with_(base, frontends={"count": 3})))
    assert apply_plan.nginx_differs(with_(base, nginx={"gzip": True}), [tried], base, on_disk)


def test_a_key_both_read_restarts_both(base):
    steps = apply_plan.plan(base, with_(base, frontends={"hung_kill_s": 9.0}), NONE)
    assert steps.roll_workers and steps.roll_frontends


def test_more_frontends_start_and_the_others_restart_the_workers_stay(base):
    steps = apply_plan.plan(base, with_(base, frontends={"count": 3}),
                       {**NONE, "added": ["frontends:frontend-2"]})
    assert steps.add_frontends == ["frontend-2"]
    assert steps.roll_frontends == ["frontend-0", "frontend-1"] and steps.roll_workers == []


def test_more_workers_start_and_the_frontends_restart_to_route_to_them(base):
    steps = apply_plan.plan(base, with_(base, workers={"cpu_workers": 3}),
                       {**NONE, "added": ["workers:worker-2"]})
    assert steps.add_workers == ["worker-2"] and steps.roll_workers == []
    assert steps.roll_frontends == ["frontend-0", "frontend-1"]
    fewer = apply_plan.plan(base, with_(base, workers={"cpu_workers": 1}),
                       {**NONE, "removed": ["workers:worker-1"]})
    assert fewer.remove_workers == ["worker-1"] and fewer.roll_workers == []
    assert fewer.roll_frontends == ["frontend-0", "frontend-1"]


def test_a_program_supervisord_runs_otherwise_restarts(base):
    """A program section that changed (its environment, logs) restarts that process even when
    no key its code reads did."""
    steps = apply_plan.plan(base, with_(base, limits={"max_texts_per_request": 8}),
                       {**NONE, "changed": ["workers:worker-1"]})
    assert steps.roll_workers == ["worker-1"]


# The code each side runs (its package and the shmserve modules it uses at run time; config.py,
# checks.py and render.py read every key to validate or render it, not to serve).
WORKER_CODE = ["gpu_workers/*.py", "shmserve/admission.py", "shmserve/arena.py",
               "shmserve/hung.py", "shmserve/models.py", "shmserve/protocol.py",
               "shmserve/state.py", "shmserve/wire.py", "shmserve/logs.py",
               "shmserve/metrics.py", "shmserve/topology.py"]
FRONTEND_CODE = ["frontend/*.py", *WORKER_CODE[1:]]
READ = re.compile(r"(?:\bcfg|\bconfig|\[CONFIG\])\.(\w+)(?:\.(\w+))?")


def reads(patterns: list[str]) -> dict[str, set[str]]:
    """Keys the code reads by name: {"section.key", ...} with "section.*" for a whole
    section handed on."""
    out: dict[str, set[str]] = {}
    sections = {f.name for f in dataclasses.fields(config.Config)}
    for pattern in patterns:
        for path in REPO_ROOT.glob(pattern):
            for match in READ.finditer(path.read_text()):
                section, key = match.groups()
                if section in sections:
                    out.setdefault(f"{section}.{key or '*'}", set()).add(path.name)
    return out


def test_no_worker_code_reads_a_key_apply_spares_the_workers_for():
    spared = {key: files for key, files in reads(WORKER_CODE).items()
              if key.startswith(apply_plan.FRONTEND_SIDE) and key not in apply_plan.READ_BY_WORKERS}
    # frontends.count: a worker reads it once, at its start, for the frontends already
    # running; the others it learns from their pings (gpu_workers/watch.py).
    assert spared == {"frontends.count": {"watch.py"}}, spared
    wholes = {key for key in reads(WORKER_CODE) if key.endswith(".*")}
    assert not any(whole[:-1].startswith(apply_plan.FRONTEND_SIDE) for whole in wholes), wholes


def test_no_frontend_code_reads_a_key_apply_spares_the_frontends_for():
    spared = {key: files for key, files in reads(FRONTEND_CODE).items()
              if key.startswith(apply_plan.WORKER_SIDE) and key not in apply_plan.READ_BY_FRONTENDS}
    assert spared == {}, spared
    assert reads(FRONTEND_CODE)["batching.max_batch_size"] == {"info.py"}  # the scan sees it
    nginx = {key for key in reads(FRONTEND_CODE) if key.startswith("nginx.")}
    assert nginx == set(apply_plan.NGINX_READ_BY_FRONTENDS), nginx  # app[CONFIG].nginx.... too
    assert not set(apply_plan.NGINX_ONLY) & set(reads(FRONTEND_CODE))  # nginx's address
    assert not any(apply_plan.frontend_reads(k) for k in apply_plan.NGINX_ONLY)
    wholes = {key for key in reads(FRONTEND_CODE) if key.endswith(".*")}
    assert not any(whole[:-1].startswith(apply_plan.WORKER_SIDE) for whole in wholes), wholes


def test_a_changed_model_config_drops_what_reload_and_split_set_for_it(tmp_path, monkeypatch):
    """A reloaded source kept in run/state.json would win over the model's new config in every
    restarted worker (gpu_workers.slots.hosted_configs): apply drops it for the models whose
    config changed, and keeps it for the others."""
    from shmserve import state

    models = [{"name": "m", "source": "/nonexistent/m"}, {"name": "n", "source": "/x/n"}]
    old = make_config(tmp_path / "run", models=models)
    old.run_dir.mkdir(parents=True)
    state.update(old, lambda tree: tree.update(
        sources={"m": {"source": "/reloaded/m", "revision": "r2"},
                 "n": {"source": "/reloaded/n", "revision": "r3"}},
        splits={"n": {"a": 1.0}}))
    new = make_config(tmp_path / "run", models=[{**models[0], "source": "/new/m"}, models[1]])
    # a dry run says what it would drop, and drops nothing (it said nothing: an outside check)
    said = []
    monkeypatch.setattr(apply_plan, "say", said.append)
    assert apply.forget_overridden(old, new, dry_run=True) == ["m"]
    assert set(state.read(new).sources) == {"m", "n"}
    assert said and "the reloaded weights of m would be dropped" in said[0], said
    assert "until then the workers not yet restarted answer with the reloaded" in said[0]
    assert apply.forget_overridden(old, new) == ["m"]
    assert "the reloaded weights of m are dropped" in said[1], said
    kept = state.read(new)
    assert set(kept.sources) == {"n"} and set(kept.splits) == {"n"}
    assert apply.forget_overridden(new, new) == []
    # Any key of a model's config, not only its source: its reloaded weights go too (they
    # were kept while the message said dropped: an outside check), and its split
    limited = make_config(tmp_path / "run", models=[models[0], {**models[1],
                                                               "max_input_tokens": 64}])
    assert apply.forget_overridden(new, limited) == ["n"]
    kept = state.read(limited)
    assert kept.sources == {} and kept.splits == {}


def test_apply_refuses_while_a_reload_of_a_model_it_changes_is_under_way(tmp_path):
    """A reload under way when apply dropped its model's reloaded weights wrote them back
    after, and the restarted workers served them, not the config apply said served (an
    outside check): apply holds the changed models' reload locks, and refuses at once when a
    reload holds one."""
    from shmserve import state
    from shmserve.cli import CliError

    models = [{"name": "m", "source": "/cfg/m"}, {"name": "n", "source": "/cfg/n"}]
    old = make_config(tmp_path / "run", models=models)
    new = make_config(tmp_path / "run", models=[{**models[0], "dtype": "fp32"}, models[1]])
    old.run_dir.mkdir(parents=True)
    with state.reloading(old, "n"):  # another model's reload: apply goes ahead
        with apply.reloads_held(old, new):
            with pytest.raises(state.Busy):  # and a reload of m waits for it
                with state.reloading(old, "m"):
                    pass
    with state.reloading(old, "m"):
        with pytest.raises(CliError, match="a reload of m is under way .* nothing was changed"):
            with apply.reloads_held(old, new):
                pass


def test_one_apply_at_a_time(tmp_path):
    from shmserve.cli import CliError

    cfg = make_config(tmp_path / "run")
    cfg.run_dir.mkdir(parents=True)
    with apply.exclusive(cfg):
        with pytest.raises(CliError, match="another `shmserve apply` runs"):
            with apply.exclusive(cfg):
                pass
    with apply.exclusive(cfg):  # released at the end of the first
        assert apply.running_now(cfg)
    assert not apply.running_now(cfg)


def test_a_dry_run_tells_the_programs_started_and_stopped_from_the_counts(base):
    grown = with_(base, frontends={"count": 3}, workers={"cpu_workers": 1})
    assert apply_plan.by_counts(base, grown) == {"added": ["frontends:frontend-2"],
                                            "removed": ["workers:worker-1"], "changed": []}
    # An apply to three frontends stopped part way, then the count put back: supervisord runs
    # frontend-2, which the counts alone (2 -> 2) did not list (an outside check)
    running = ["workers:worker-0", "workers:worker-1", "frontends:frontend-0",
               "frontends:frontend-1", "frontends:frontend-2", "nginx:nginx"]
    assert apply_plan.by_counts(base, base, running) == {
        "added": [], "removed": ["frontends:frontend-2"], "changed": []}
    assert apply_plan.by_counts(base, grown, running[:3]) == {
        "added": ["frontends:frontend-1", "frontends:frontend-2"], "removed": ["workers:worker-1"],
        "changed": []}


def test_an_apply_without_ups_config_file_is_told_so(base, tmp_path):
    """An apply that leaves out the --config file `up` read puts back every key it set (the
    port too); the differences alone did not say why (an outside check moved to port 8080)."""
    import json

    from shmserve import topology

    given = tmp_path / "overlay.yaml"
    given.write_text("server: {port: 20480}\n")
    base.run_dir.mkdir(parents=True)
    topology.config_files_path(base).write_text(json.dumps({str(given.resolve()): "digest"}))
    port = ["server.port"]  # the keys the apply changes
    assert apply_sources.files_dropped(base, [], port) == [str(given.resolve())]
    assert apply_sources.files_dropped(base, [given], port) == []
    # said only where a key the file set changes: one whose port the other layers give too
    # was told its port went back (an outside check)
    assert apply_sources.files_dropped(base, [], ["batching.max_wait_ms"]) == []
    assert apply_sources.files_dropped(base, [], ["server"]) == [str(given.resolve())]
    given.write_text("models:\n  - {name: a, source: b}\n")
    assert apply_sources.files_dropped(base, [], ["models"]) == [str(given.resolve())]
    given.unlink()  # gone since: what it set cannot be told, so it is said
    assert apply_sources.files_dropped(base, [], ["batching.max_wait_ms"]) == [str(given.resolve())]
    topology.config_files_path(base).unlink()  # an older deployment's `up` kept none
    assert apply_sources.files_dropped(base, [], port) == []
    # how to give each back: an env's file with --env (it said --config for `up --env prod`)
    from shmserve.layers import CONFIG_DIR

    assert apply_sources._how_given([str((CONFIG_DIR / "prod.yaml").resolve()), str(given)]) == (
        "give --env prod or SHMSERVE_ENV=prod; give overlay.yaml with --config or "
        "SHMSERVE_CONFIG")
    assert "--config" in apply_sources._how_given([str((CONFIG_DIR / "gpu.yaml").resolve())])


def test_an_apply_without_ups_variables_is_told_so(base):
    """As with a file: the SHMSERVE__ variables `up` read that this apply's environment
    lacks (names only: their values may be secrets)."""
    import json

    from shmserve import topology

    base.run_dir.mkdir(parents=True)
    changed = ["admin.token", "server.port", "models"]  # the keys the apply changes
    assert apply_sources.variables_dropped(base, {}, changed) == []  # an older `up` kept no record
    topology.config_variables_path(base).write_text(json.dumps(
        ["SHMSERVE__ADMIN__TOKEN", "SHMSERVE__SERVER__PORT", "SHMSERVE__MODELS__0__SOURCE"]))
    assert apply_sources.variables_dropped(base, {"SHMSERVE__ADMIN__TOKEN": "x"}, changed) == [
        "SHMSERVE__SERVER__PORT", "SHMSERVE__MODELS__0__SOURCE"]
    assert apply_sources.variables_dropped(base, {"SHMSERVE__ADMIN__TOKEN": "x",
                                          "SHMSERVE__SERVER__PORT": "1"}, changed) == [
        "SHMSERVE__MODELS__0__SOURCE"]
    # only where the key it set changes: the files gave the same port (an outside check was
    # told its port would go back, and nothing changed)
    assert apply_sources.variables_dropped(base, {}, ["admin.token"]) == ["SHMSERVE__ADMIN__TOKEN"]
    assert apply_sources.variables_dropped(base, {}, ["batching.max_wait_ms"]) == []


def test_an_apply_down_to_one_frontend_or_worker_warns_of_the_next_restarts_gap(base, capsys):
    """Down to one frontend or worker, the apply itself is served throughout, but the next
    restart of that program is not: said, as `restart` says it (an outside check found apply
    silent where the README names two or more as the condition)."""
    from shmserve.apply_plan import Plan

    one = with_(base, frontends={"count": 1}, workers={"cpu_workers": 1})
    apply_plan.warn_gaps(base, one, Plan(remove_frontends=["frontend-1"],
                                    remove_workers=["worker-1"]))
    said = capsys.readouterr().err
    assert "one program in frontends from now on" in said and "nginx answers 502" in said
    assert "one program in workers from now on" in said and "answered 503" in said
    apply_plan.warn_gaps(one, base, Plan(add_frontends=["frontend-1"], add_workers=["worker-1"]))
    assert "one program" not in capsys.readouterr().err  # growing: nothing to say


def test_a_model_changing_to_variants_is_warned_of(base, capsys):
    """A model turned into A/B variants (or back) fails its requests meanwhile: said (the dry
    run now says it too; only the run did, once the change was under way: an outside
    check)."""
    from shmserve.apply_plan import Plan

    apply_plan.warn_gaps(base, base, Plan(reshaped=["m"]))
    said = capsys.readouterr().err
    assert "what the workers load under m changes" in said and "requests for it fail" in said


def test_another_spelling_of_the_same_host_is_no_move(monkeypatch):
    """localhost for 127.0.0.1 (as this machine resolves it) binds the same socket: no --move
    asked for, and no "in use by another process" from the port check (recheck43b)."""
    import socket

    resolved = {"localhost": ["127.0.0.1"], "127.0.0.1": ["127.0.0.1"], "::1": ["::1"],
                "dual": ["127.0.0.1", "::1"]}

    def getaddrinfo(host, port, type=0):
        if host not in resolved:
            raise socket.gaierror(host)
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, type, 6, "", (a, port))
                for a in resolved[host]]
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)

    def at(host):
        return config.from_tree({"models": [{"name": "m", "source": "/m"}],
                                 "server": {"host": host, "port": 8080}})
    assert moves.same_listen(at("127.0.0.1"), at("localhost"))
    assert not moves.same_listen(at("127.0.0.1"), at("::1"))
    assert not moves.same_listen(at("127.0.0.1"), at("dual"))
    assert not moves.same_listen(at("127.0.0.1"), at("nowhere"))  # does not resolve


def test_a_name_resolving_to_the_old_address_among_others_is_said_to_overlap(monkeypatch):
    """localhost resolving to 127.0.0.1 and ::1 is a move from 127.0.0.1, and its port check
    failed on this deployment's own nginx: it said "in use by another process" (recheck43b)."""
    import socket

    from shmserve.prechecks import CliError

    def getaddrinfo(host, port, type=0):
        found = {"127.0.0.1": ["127.0.0.1"], "dual": ["127.0.0.1", "::1"]}[host]
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, type, 6, "", (a, port))
                for a in found]
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)

    def held(cfg, keys=()):
        raise CliError(f"{cfg.server.host}:{cfg.server.port} is in use by another process")
    monkeypatch.setattr(moves, "check_port", held)

    def at(host):
        return config.from_tree({"models": [{"name": "m", "source": "/m"}],
                                 "server": {"host": host, "port": 8080}})
    with pytest.raises(CliError, match="this deployment's nginx holds the old address"):
        moves.check_address(at("127.0.0.1"), at("dual"))
