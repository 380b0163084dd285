"""`shmserve apply`: a changed config taken by the running deployment one process at a time,
counts of frontends and workers included, under load, without a failed request."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
import yaml

from shmserve import render, topology
from shmserve.config import load_resolved
from tests.conftest import tiny_overrides
from tests.e2e.test_operations import Traffic
from tests.stack import Stack, bindable, deep_merge, free_port


@pytest.fixture
def stack(two_of_each):
    return two_of_each


def edit(stack: Stack, **sections) -> None:
    """Change the deployment's config file as an operator edits it."""
    tree = yaml.safe_load(stack.config_file.read_text())
    stack.config_file.write_text(yaml.safe_dump(deep_merge(tree, sections)))


def programs(stack: Stack) -> dict[str, int]:
    """Every frontend's and worker's pid by name, as supervisord runs them (a program in its
    first second, STARTING, waited for)."""
    deadline = time.monotonic() + 15
    while True:
        ours = [p for p in stack.processes() if p["group"] in ("frontends", "workers")]
        if ours and all(p["statename"] == "RUNNING" for p in ours):
            return {p["name"]: p["pid"] for p in ours}
        assert time.monotonic() < deadline, ours
        time.sleep(0.2)


def ready_workers(stack: Stack) -> list[int]:
    _, _, body = stack.get("/ready")
    return sorted(w["worker"] for w in json.loads(body)["workers"] if w["ready"])


def test_apply_scales_frontends_and_workers_up_and_down_under_load(stack):
    """From 2 frontends and 2 workers to 3 and 3 with a new limit, then back, while clients
    send all along: every request answered 200, the new processes serve, the old ones kept
    where nothing they read changed, and supervisord's groups end equal to the rendered file
    (a later `supervisorctl update` changes nothing)."""
    assert "nothing to apply" in stack.cli("apply").stdout
    before = programs(stack)
    with Traffic(stack) as traffic:
        traffic.wait_for(20)
        edit(stack, frontends={"count": 3}, workers={"cpu_workers": 3},
             limits={"max_texts_per_request": 8})
        dry = stack.cli("apply", "--dry-run")
        assert "frontends.count: 2 -> 3" in dry.stdout and "nothing changed" in dry.stdout
        assert "would apply:" in dry.stdout and "applying" not in dry.stdout, dry.stdout
        assert "start: worker-2" in dry.stdout and "start: frontend-2" in dry.stdout
        assert programs(stack) == before
        done = stack.cli("apply", timeout=400)
        assert "shmserve: applied" in done.stdout, done.stdout + done.stderr
        # the reaper (it names every program) restarts, as the plan said, and says so
        assert "restart: reaper" in dry.stdout and "shmserve: reaper restarted" in done.stdout
        # what it added was started, not restarted
        assert "started worker-2 (pid" in done.stdout and "restarted worker-2" not in \
            done.stdout, done.stdout
        assert "started frontend-2 (pid" in done.stdout, done.stdout
        traffic.wait_for(20)
        grown = programs(stack)
        assert set(grown) == {"frontend-0", "frontend-1", "frontend-2", "worker-0",
                              "worker-1", "worker-2"}
        # The frontends restarted (a new limit, a new worker to route to); the workers were
        # kept: nothing they read changed, and worker-2 is a process of its own.
        assert [grown[p] != before[p] for p in sorted(before)] == [True, True, False, False]
        assert ready_workers(stack) == [0, 1, 2]
        assert stack.post_json("/predict", {"texts": ["x"] * 9})[0] == 413  # the new limit
        assert load_resolved(stack.run_dir / "config.json").frontends.count == 3

        edit(stack, frontends={"count": 2}, workers={"cpu_workers": 2})
        done = stack.cli("apply", timeout=400)
        assert "shmserve: applied" in done.stdout, done.stdout + done.stderr
        traffic.wait_for(20)
    shrunk = programs(stack)
    assert set(shrunk) == {"frontend-0", "frontend-1", "worker-0", "worker-1"}
    # Fewer workers: every frontend restarted to forget worker-2; the workers kept were not.
    assert all(shrunk[f] != grown[f] for f in ("frontend-0", "frontend-1"))
    assert all(shrunk[w] == grown[w] for w in ("worker-0", "worker-1"))
    assert ready_workers(stack) == [0, 1]
    failed = [s for s in traffic.outcomes if s != "200"]
    assert len(traffic.outcomes) > 100 and not failed, (len(traffic.outcomes), failed[:5])
    assert not topology.frontend_socket(load_resolved(stack.run_dir / "config.json"),
                                        2).exists()
    assert not (stack.run_dir / "apply.json").exists()
    assert "No config updates" in stack.ctl("reread")  # groups as the file says
    assert "nothing to apply" in stack.cli("apply").stdout


def test_apply_restarts_only_what_reads_a_changed_key_and_goes_on_after_a_failure(stack):
    """A worker-side key restarts the workers alone, a frontend-side key the frontends alone,
    and an nginx setting reloads nginx in place; an apply stopped part way goes on."""
    before = programs(stack)
    nginx = stack.pid("nginx")
    edit(stack, batching={"max_wait_ms": 3})
    done = stack.cli("apply", timeout=300)
    assert "worker-0, worker-1" in done.stdout and "frontend-0" not in done.stdout, done.stdout
    after = programs(stack)
    assert [after[p] != before[p] for p in sorted(before)] == [False, False, True, True]

    edit(stack, frontends={"max_inflight": 77})
    done = stack.cli("apply", timeout=300)
    assert "restart one at a time: frontend-0, frontend-1" in done.stdout, done.stdout
    last = programs(stack)
    assert [last[p] != after[p] for p in sorted(after)] == [True, True, False, False]

    # A host that overlaps the one nginx holds, on the same port: said, not blamed on "another
    # process" (an outside check had left out `up`'s --env prod), with the changes listed first
    edit(stack, server={"host": "0.0.0.0"})
    moved = stack.cli("apply", "--dry-run", check=False)
    edit(stack, server={"host": "127.0.0.1"})
    assert moved.returncode == 2, moved.stdout + moved.stderr
    assert 'server.host: "127.0.0.1" -> "0.0.0.0"' in moved.stdout, moved.stdout
    assert f"server.host: 127.0.0.1 -> 0.0.0.0 on the same port {stack.port}: this " \
        "deployment's nginx holds the old address" in moved.stderr, moved.stderr
    assert "another process" not in moved.stderr
    # A new port: warned of, as an `up` override left out would change it
    edit(stack, server={"port": (port := free_port())})
    moved = stack.cli("apply", "--dry-run", check=False)
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert f"warning: nginx moves from 127.0.0.1:{stack.port} to 127.0.0.1:{port}: clients " \
        "of the old address lose it" in moved.stderr, moved.stderr
    assert "(an apply of this needs --move)" in moved.stderr
    # and a real one is refused without --move, before anything changes (an outside check's
    # `apply --env prod` without up's overrides moved a loopback deployment to 0.0.0.0:8080)
    refused = stack.cli("apply", check=False)
    edit(stack, server={"port": stack.port})
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "this apply moves where clients reach the deployment (above): give --move" in \
        refused.stderr, refused.stderr
    # said as refused before anything changed: its listed changes read "applying:" above the
    # refusal, as if done (an outside check)
    assert "(nothing was applied)" in refused.stderr and "applying" not in refused.stdout
    assert f"server.port: {stack.port} -> {port}" in refused.stdout, refused.stdout
    assert stack.get("/health")[0] == 200 and bindable(port)  # nginx did not move

    edit(stack, nginx={"rate_limit_per_s": 50})  # nginx's alone: a reload, no restart
    dry = stack.cli("apply", "--dry-run")
    assert "reload its configuration: nginx" in dry.stdout, dry.stdout
    old_workers = nginx_workers(nginx)
    done = stack.cli("apply", timeout=300)
    assert "reload its configuration: nginx" in done.stdout and "restart one" not in done.stdout
    assert programs(stack) == last
    assert stack.pid("nginx") == nginx  # reloaded, not restarted
    # ... and it returned once the new nginx workers ran and the old ones had gone (it returned
    # at the signal: a request right after could still meet the old configuration)
    new_workers = nginx_workers(nginx)
    assert old_workers and new_workers and not old_workers & new_workers, (old_workers,
                                                                           new_workers)
    conf = render.nginx_conf(load_resolved(stack.run_dir / "config.json"))
    assert "limit_req_zone $shmserve_rate_limit_key zone=shmserve_rate_ip:" in conf.read_text()
    assert "default $binary_remote_addr;" in conf.read_text()  # the key, but for the probes
    # A configuration nginx -t passes and a reload refuses (a zone kept across reloads whose key
    # changed, as switching nginx.rate_limit_key did before each key had its zone): nginx is
    # restarted instead, and says why (apply and restart said "reloaded"; the old ran on).
    rendered = conf.read_text()
    conf.write_text(rendered.replace("limit_req_zone $shmserve_rate_limit_key",
                                     "limit_req_zone $http_x_client"))
    done = stack.cli("restart", "nginx")
    assert 'nginx refused to reload its configuration (' in done.stderr, done.stderr
    assert 'uses the "$http_x_client" key while previously' in done.stderr, done.stderr
    assert stack.pid("nginx") != nginx and stack.post_json("/predict", {"texts": ["x"]})[0] == 200
    conf.write_text(rendered)  # as rendered again, for the steps below
    stack.cli("ctl", "restart", "nginx")
    # The same config, an nginx.conf an older shmserve rendered (an upgrade changed the
    # template): apply renders and reloads it (it said "nothing to apply", the old rules ran on)
    conf.write_text(rendered.replace("limit_req_log_level info;", "limit_req_log_level warn;"))
    master = stack.pid("nginx")
    done = stack.cli("apply", timeout=300)
    assert "nginx.conf as this shmserve renders it differs from the running one" in \
        done.stdout and "reload its configuration: nginx" in done.stdout, done.stdout
    assert conf.read_text() == rendered and stack.pid("nginx") == master  # reloaded
    assert "nothing to apply" in stack.cli("apply").stdout  # and then nothing

    # The same stack goes on (one stack less to start in the suite):
    # A step that fails (here a frontend not ready within --timeout) stops the apply with the
    # old config kept in run/apply.json; the next apply goes on from there, nginx reloaded
    # although its file was already the new one.
    edit(stack, frontends={"count": 3})
    failed = stack.cli("apply", "--timeout", "0.01", check=False, timeout=300)
    assert failed.returncode == 2 and "`shmserve apply` again" in failed.stderr, failed.stderr
    assert (stack.run_dir / "apply.json").exists()
    # (the file named where it is: it said run/apply.json whatever the run directory: recheck51)
    assert f"({stack.run_dir / 'apply.json'} keeps the config" in failed.stderr, failed.stderr
    # A frontend the apply had not reached, crashed: it starts again on the config it ran
    # (2 frontends, not 3: supervisord started it on the new config, out of the apply's order,
    # and a crash during an apply changing a model's units so served that model 503s: an
    # outside check); frontend-2, which the apply added, runs the new one.
    before_pid = stack.pid("frontends:frontend-0")
    os.kill(before_pid, signal.SIGKILL)
    stack.wait_until(lambda: stack.pid("frontends:frontend-0") not in (0, before_pid), 30,
                     "frontend-0 started again")
    stack.wait_until(lambda: None not in (frontend_info(stack, 0), frontend_info(stack, 2)),
                     30, "frontend-0 and frontend-2 answering")
    assert frontend_info(stack, 0)["frontends"] == 2 and frontend_info(stack, 2)["frontends"] == 3
    assert any(line.get("message") == "frontend.config_before_apply"
               for line in stack.log_lines("frontend-0"))
    warned = stack.cli("restart", "nginx", check=False)  # restarted programs: its config
    assert f"an apply stopped part way ({stack.run_dir / 'apply.json'})" in warned.stderr, \
        warned.stderr
    shown = stack.cli("status", check=False)  # it shows the config being applied: says so
    assert "an apply stopped part way" in shown.stderr, shown.stderr
    done = stack.cli("apply", timeout=300)
    assert "stopped part way" in done.stdout and "reload its configuration: nginx" in done.stdout
    assert "shmserve: applied" in done.stdout
    assert not (stack.run_dir / "apply.json").exists()
    assert set(programs(stack)) == {"frontend-0", "frontend-1", "frontend-2", "worker-0",
                                    "worker-1"}
    assert frontend_info(stack, 0)["frontends"] == 3  # reached by the apply: the new config
    assert "nothing to apply" in stack.cli("apply").stdout
    # Given up instead: the config put back as it was, the next apply stops what the failed
    # one started (here frontend-3), although the config no longer differs from the one before.
    edit(stack, frontends={"count": 4})
    assert stack.cli("apply", "--timeout", "0.01", check=False, timeout=300).returncode == 2
    edit(stack, frontends={"count": 3})
    done = stack.cli("apply", timeout=300)
    assert "frontend-3" in done.stdout and "shmserve: applied" in done.stdout, done.stdout
    assert set(programs(stack)) == {"frontend-0", "frontend-1", "frontend-2", "worker-0",
                                    "worker-1"}

    # A hand-edited nginx.conf nginx rejects: `restart nginx` says so and leaves nginx as it
    # runs (it said it reloaded the file, which nginx had refused: an outside check).
    conf = render.nginx_conf(load_resolved(stack.run_dir / "config.json"))
    kept = {conf: conf.read_text()}
    conf.write_text("no_such_directive on;\n" + kept[conf])  # edited by hand
    broken = [stack.cli("restart", "nginx", *flag, check=False)
              for flag in ((), ("--all-at-once",))]  # restarted on it, nginx stayed down
    conf.write_text(kept[conf])
    for done in broken:
        assert done.returncode == 2 and "nginx rejects the file" in done.stderr, done.stderr
        assert "reloaded" not in done.stdout
    assert stack.get("/health")[0] == 200


def frontend_info(stack: Stack, index: int) -> dict | None:
    """GET /info of one frontend, on its own socket (None while it does not answer)."""
    from shmserve.remote import get_unix

    code, raw = get_unix(str(stack.run_dir / "sockets" / f"frontend-{index}.sock"), "/info")
    return json.loads(raw) if code == 200 else None


def nginx_workers(master: int) -> set[int]:
    return {child.pid for child in psutil.Process(master).children()}


def test_from_one_frontend_and_one_worker_to_two_of_each_without_a_failed_request(
        tmp_path, tiny_model):
    """One frontend growing to two got 502s (nginx knew only the one restarting), and one
    worker growing to two with a key the workers read got 503s (the kept worker restarted
    before the frontends knew the new one): an outside check. Now the new frontend is in
    nginx first, and the frontends learn the new worker before the kept one restarts."""
    stack = Stack(tmp_path / "one", tiny_overrides(
        tiny_model, frontends={"count": 1}, workers={"devices": "cpu", "cpu_workers": 1,
                                                     "torch_threads": 1}))
    stack.env["SHMSERVE__LIMITS__MAX_TEXTS_PER_REQUEST"] = "48"  # the file says 64
    stack.env["SHMSERVE__LIMITS__MAX_TEXT_CHARS"] = "100000"  # the files' value, again
    stack.up()
    try:
        with Traffic(stack) as traffic:
            traffic.wait_for(20)
            edit(stack, frontends={"count": 2}, workers={"cpu_workers": 2},
                 batching={"max_wait_ms": 3})
            # An apply without a variable `up` was given says so where the key it set
            # changes; not for one the files give the same value (an outside check was told
            # its port would go back, and nothing changed)
            del stack.env["SHMSERVE__LIMITS__MAX_TEXTS_PER_REQUEST"]
            del stack.env["SHMSERVE__LIMITS__MAX_TEXT_CHARS"]
            dry = stack.cli("apply", "--dry-run")
            assert "the running config was given SHMSERVE__LIMITS__MAX_TEXTS_PER_REQUEST, " \
                "which this apply's environment does not set" in dry.stdout, dry.stdout
            assert "limits.max_texts_per_request: 48 -> 64" in dry.stdout
            assert "MAX_TEXT_CHARS" not in dry.stdout, dry.stdout
            done = stack.cli("apply", timeout=400)
            assert "shmserve: applied" in done.stdout, done.stdout + done.stderr
            traffic.wait_for(20)
        assert set(programs(stack)) == {"frontend-0", "frontend-1", "worker-0", "worker-1"}
        failed = [s for s in traffic.outcomes if s != "200"]
        assert len(traffic.outcomes) > 50 and not failed, (len(traffic.outcomes), failed[:5])
    finally:
        stack.down()


def test_a_renamed_default_model_is_served_throughout(stack):
    """Models both added and removed: the workers used to restart first, so the old
    frontends' default model (the one a request naming none gets) went unserved from the
    last of its workers' restarts until the frontends restarted: 503s (an outside check).
    Now one worker loads the new model while the other still serves the old one, then the
    frontends restart, then the other worker; then the same for the model split into A/B
    arms under its name (which was warned of as a gap)."""
    tree = yaml.safe_load(stack.config_file.read_text())
    renamed = {**tree["models"][0], "name": "tiny2", "aliases": []}
    with Traffic(stack) as traffic:  # requests naming no model
        traffic.wait_for(20)
        stack.config_file.write_text(yaml.safe_dump({**tree, "models": [renamed]}))
        done = stack.cli("apply", timeout=400)
        assert "shmserve: applied" in done.stdout, done.stdout + done.stderr
        assert ("restart one at a time: worker-0\n  restart one at a time: frontend-0, "
                "frontend-1\n  restart one at a time: worker-1") in done.stdout, done.stdout
        traffic.wait_for(20)
        arms = {k: v for k, v in renamed.items() if k not in ("source", "revision")}
        arms["variants"] = [{"name": arm, "source": renamed["source"], "revision": arm}
                            for arm in ("a", "b")]
        stack.config_file.write_text(yaml.safe_dump({**tree, "models": [arms]}))
        done = stack.cli("apply", timeout=400)
        assert "shmserve: applied" in done.stdout and "warning" not in done.stderr, \
            done.stdout + done.stderr
        traffic.wait_for(20)
    failed = [s for s in traffic.outcomes if s != "200"]
    assert len(traffic.outcomes) > 100 and not failed, (len(traffic.outcomes), failed[:5])
    assert stack.post_json("/predict", {"texts": ["x"], "model": "tiny2"})[0] == 200
    assert stack.post_json("/predict", {"texts": ["x"], "model": "tiny"})[0] == 404


def test_status_watch_says_an_apply_runs_while_it_runs(stack):
    """`status --watch` read the apply's state once, at its start: a watch begun during an
    apply said "running" to its end, one begun before never said it (an outside check). The
    watch is stopped two frames after the apply returned."""
    import subprocess
    import sys
    import threading

    from tests.stack import REPO

    frames: list = []
    with subprocess.Popen([sys.executable, "-m", "shmserve.cli", "status", "--json", "--watch",
                           "0.5", "--config", str(stack.config_file)],
                          cwd=REPO, env=stack.env, stdout=subprocess.PIPE, text=True) as watch:
        reading = threading.Thread(target=lambda: frames.extend(map(json.loads, watch.stdout)))
        reading.start()
        try:
            stack.wait_until(lambda: len(frames) >= 2, 60, "two frames before the apply")
            edit(stack, batching={"max_wait_ms": 4})
            assert "shmserve: applied" in stack.cli("apply", timeout=300).stdout
            applied = len(frames)
            stack.wait_until(lambda: len(frames) >= applied + 2, 60, "two frames after it")
        finally:  # (the frames are what it is for: its exit is not checked here)
            watch.kill()
            reading.join(30)
    said = [f.get("apply") for f in frames]
    assert said[0] is None and "running" in said and said[-1] is None, said


def test_a_program_stopped_by_a_command_stays_stopped_through_restarts_and_applies(stack):
    """An operator's `shmserve ctl stop workers:worker-1` (a device under repair) was undone
    by the next rolling restart of the group, and by an apply that restarted the workers
    (supervisord autostarted the program it made anew). Both now leave it stopped, say so, and
    restart the others; started again, it runs as the file says (nothing left to apply)."""
    stack.ctl("stop", "workers:worker-1")
    assert stack.info("workers:worker-1")["statename"] == "STOPPED"
    kept = stack.pid("workers:worker-0")
    done = stack.cli("restart", "workers", timeout=300)
    assert "worker-1 is stopped (a stop command): left stopped" in done.stdout, done.stdout
    assert stack.info("workers:worker-1")["statename"] == "STOPPED"
    assert stack.pid("workers:worker-0") not in (0, kept)
    kept = stack.pid("workers:worker-0")  # all at once: the running ones, by name
    done = stack.cli("restart", "workers", "--all-at-once", timeout=300)
    assert "worker-1 is stopped (a stop command): left stopped" in done.stdout, done.stdout
    assert stack.info("workers:worker-1")["statename"] == "STOPPED"
    assert stack.pid("workers:worker-0") not in (0, kept)

    kept = stack.pid("workers:worker-0")
    edit(stack, batching={"max_wait_ms": 3})  # a key the workers read: they restart
    done = stack.cli("apply", timeout=300)
    assert "worker-1 is stopped (a stop command): left stopped, on the new config" in \
        done.stdout and "shmserve: applied" in done.stdout, done.stdout
    assert stack.info("workers:worker-1")["statename"] == "STOPPED"
    assert stack.pid("workers:worker-0") not in (0, kept)
    assert stack.post_json("/predict", {"texts": ["one worker serves"]})[0] == 200

    stack.ctl("start", "workers:worker-1")
    stack.wait_until(lambda: ready_workers(stack) == [0, 1], 90, "worker-1 ready again")
    assert "nothing to apply" in stack.cli("apply").stdout
