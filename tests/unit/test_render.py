"""Rendering a run directory: config.json, supervisord.conf, nginx.conf and nginx's error pages.

The supervisord config is read back by supervisord's own parser; the nginx config is checked by
``nginx -t`` and, at the end, served by a real nginx (no frontend behind it) on an ephemeral port.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
from supervisor.datatypes import RestartUnconditionally
from supervisor.options import EventListenerPoolConfig, ServerOptions

from shmserve import config, layers, nginx_options, render, supervisor_files, topology
from shmserve.config import REPO_ROOT, Config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_config(run_dir: Path, **sections: dict[str, Any]) -> Config:
    tree: dict[str, Any] = {
        "models": [{"name": "m", "source": "/nonexistent/m"}],
        "server": {"run_dir": str(run_dir), "port": free_port(), "drain_timeout_s": 7.5},
        "workers": {"devices": "cpu", "cpu_workers": 1},  # not auto: a count of its own
    }
    return config.from_tree(layers.deep_merge(tree, sections))


def programs(cfg: Config) -> dict[str, Any]:
    """supervisord's own reading of the rendered file: program name -> ProcessConfig."""
    options = ServerOptions()
    options.configfile = str(supervisor_files.supervisord_conf(cfg))
    options.process_config(do_usage=False)
    return {p.name: (group.name, p) for group in options.process_group_configs
            if not isinstance(group, EventListenerPoolConfig) for p in group.process_configs}


def test_gpu_devices_get_one_worker_each(tmp_path):
    cfg = make_config(tmp_path / "run", workers={"devices": [0, 1]})
    render.render(cfg)
    found = programs(cfg)
    workers = {name: p for name, (group, p) in found.items() if group == "workers"}
    assert sorted(workers) == ["worker-0", "worker-1"]
    devices = [workers[f"worker-{i}"].environment["CUDA_VISIBLE_DEVICES"] for i in (0, 1)]
    assert devices == ["0", "1"]
    # the numbers nvidia-smi gives, not CUDA's fastest-first order (mixed cards)
    assert {workers[f"worker-{i}"].environment["CUDA_DEVICE_ORDER"] for i in (0, 1)} == {
        "PCI_BUS_ID"}
    assert workers["worker-1"].command.endswith(
        f"-m gpu_workers --config {cfg.run_dir}/config.json --index 1")
    resolved = config.load_resolved(topology.resolved_config_path(cfg))
    assert resolved.workers.devices == [0, 1]


def test_per_gpu_runs_that_many_workers_on_each_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(topology, "visible_gpus", lambda: [0, 1])
    cfg = make_config(tmp_path / "run", workers={"devices": "auto", "per_gpu": 2})
    render.render(cfg)
    workers = {name: p for name, (group, p) in programs(cfg).items() if group == "workers"}
    devices = [workers[f"worker-{i}"].environment["CUDA_VISIBLE_DEVICES"] for i in range(4)]
    assert sorted(workers) == [f"worker-{i}" for i in range(4)]
    assert devices == ["0", "0", "1", "1"]
    # Every process reads the resolved file: it must name the same four workers, not eight,
    # and say what was configured (`shmserve config` prints it).
    resolved = config.load_resolved(topology.resolved_config_path(cfg))
    assert resolved.workers.devices == [0, 1] and resolved.workers.per_gpu == 2
    assert topology.worker_devices(resolved) == devices


def test_cpu_serving_gets_cpu_workers_without_a_gpu(tmp_path, monkeypatch):
    # torch sets it in a process that used its inductor (another test in this one, say)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cfg = make_config(tmp_path / "run", workers={"devices": "cpu", "cpu_workers": 3,
                                                 "torch_threads": 1})
    render.render(cfg)
    workers = [p for group, p in programs(cfg).values() if group == "workers"]
    assert len(workers) == 3
    for worker in workers:
        env = worker.environment
        assert env["CUDA_VISIBLE_DEVICES"] == ""
        assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1"
        assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        # not /tmp/torchinductor_USER, left behind at `down` (an outside check)
        assert env["TORCHINDUCTOR_CACHE_DIR"] == str(cfg.run_dir / "torch")
    assert config.load_resolved(topology.resolved_config_path(cfg)).workers.devices == "cpu"


def test_every_program_is_supervised_the_same_way(tmp_path):
    cfg = make_config(tmp_path / "run", frontends={"count": 3})
    render.render(cfg)
    found = programs(cfg)
    assert {name: group for name, (group, _) in found.items()} == {
        "frontend-0": "frontends", "frontend-1": "frontends", "frontend-2": "frontends",
        "worker-0": "workers", "nginx": "nginx"}
    for name, (_, p) in found.items():
        assert p.autorestart is RestartUnconditionally, name
        assert p.startsecs == 1 and p.startretries >= 100, name
        assert p.stopasgroup and p.killasgroup and p.redirect_stderr, name
        assert p.stopwaitsecs >= math.ceil(cfg.server.drain_timeout_s) + 5, name
        assert p.stdout_logfile == f"{cfg.run_dir}/logs/{name}.log", name
        assert p.directory == str(REPO_ROOT), name
        assert p.command.startswith(render.interpreter() + " -m "), name
        assert p.environment["PROMETHEUS_MULTIPROC_DIR"] == str(cfg.run_dir / "metrics"), name
        assert p.environment["SHMSERVE_RUN_DIR"] == str(cfg.run_dir), name
        assert p.environment["HF_HUB_OFFLINE"] == p.environment["TRANSFORMERS_OFFLINE"] == "1"
    assert found["frontend-2"][1].command.endswith("--index 2")
    # Workers start first and stop last; nginx starts last and stops first.
    assert found["worker-0"][1].priority < found["frontend-0"][1].priority < \
        found["nginx"][1].priority


def test_log_rotation_is_configured(tmp_path):
    cfg = make_config(tmp_path / "run", logging={"max_bytes": 1 << 20, "backups": 2})
    render.render(cfg)
    for name, (_, p) in programs(cfg).items():
        assert (p.stdout_logfile_maxbytes, p.stdout_logfile_backups) == (1 << 20, 2), name
    options = ServerOptions()
    options.configfile = str(supervisor_files.supervisord_conf(cfg))
    options.process_config(do_usage=False)
    assert (options.logfile_maxbytes, options.logfile_backups) == (1 << 20, 2)


def test_nginx_config_names_every_frontend_and_passes_nginx_t(tmp_path):
    cfg = make_config(tmp_path / "run", frontends={"count": 3},
                      nginx={"client_max_body_size": "3m", "upstream_keepalive": 7})
    render.render(cfg)
    text = render.nginx_conf(cfg).read_text()
    for i in range(3):
        assert f'server "unix:{cfg.run_dir}/sockets/frontend-{i}.sock"' in text
    assert "proxy_next_upstream_tries 2;" in text and "keepalive 7;" in text
    assert "client_max_body_size 3m;" in text
    assert f"listen 127.0.0.1:{cfg.server.port} " in text
    assert "proxy_intercept_errors on" not in text
    render.check_nginx(cfg, render.nginx_binary(cfg))  # raises when nginx -t fails


def test_admin_routes_are_loopback_only_unless_configured(tmp_path):
    closed = make_config(tmp_path / "a")
    render.render(closed)
    assert "deny all;" in render.nginx_conf(closed).read_text()
    opened = make_config(tmp_path / "b", nginx={"admin_loopback_only": False})
    render.render(opened)
    assert "deny all;" not in render.nginx_conf(opened).read_text()


def test_error_pages_exist_in_both_formats_with_the_error_shape(tmp_path):
    cfg = make_config(tmp_path / "run", nginx={"client_max_body_size": "5m"})
    render.render(cfg)
    errors = render.nginx_dir(cfg) / "errors"
    for status in (400, 403, 404, 408, 413, 414, 494, 500, 502, 503, 504):
        as_json = json.loads((errors / f"{status}.json").read_text())
        as_msgpack = msgpack.unpackb((errors / f"{status}.msgpack").read_bytes())
        assert as_json == as_msgpack
        assert set(as_json) == {"error", "message"} and set(as_json["error"]) == {
            "type", "message", "param", "code"}
        assert as_json["message"] == as_json["error"]["message"]
        assert f"error_page {status} " in render.nginx_conf(cfg).read_text()
    too_large = json.loads((errors / "413.json").read_text())["error"]
    assert too_large["type"] == "too_large"
    assert "nginx.client_max_body_size (5m)" in too_large["message"]
    # The /v2 routes' pages: KServe v2's {"error": "<message>"}, the same messages.
    for status in nginx_options.NGINX_ERRORS:
        as_json = json.loads((errors / "v2" / f"{status}.json").read_text())
        assert as_json == msgpack.unpackb((errors / "v2" / f"{status}.msgpack").read_bytes())
        assert as_json == {"error": nginx_options.error_body(cfg, status)["error"]["message"]}


def test_nginx_t_failure_names_the_problem_and_replaces_nothing(tmp_path):
    # Well formed (the config checks the form), yet refused by nginx: zero buffers. What the
    # run directory held stays (a rejected nginx.conf left in place crash-looped nginx's next
    # start: an outside check).
    render.render(make_config(tmp_path / "run"))
    run = tmp_path / "run"
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    cfg = make_config(tmp_path / "run")  # past the config's checks, as a value they miss
    cfg = dataclasses.replace(cfg, nginx=dataclasses.replace(
        cfg.nginx, large_client_header_buffers="0 16k"))
    with pytest.raises(render.RenderError, match=r"nginx rejects .*large_client_header_buffers"):
        render.render(cfg)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    # the config's own checks refuse zero buffers, and a zero header buffer nginx takes
    for nginx in ({"large_client_header_buffers": "0 16k"}, {"client_header_buffer_size": "0"}):
        with pytest.raises(config.ConfigError, match="at least 1 |from 1k"):
            make_config(tmp_path / "run", nginx=nginx)
    # nor buffers a connection cannot afford: the first is allocated as one opens (1500m
    # passed `nginx -t`: an outside check)
    for nginx in ({"large_client_header_buffers": "4 2m"}, {"client_header_buffer_size": "1500m"}):
        with pytest.raises(config.ConfigError, match="from 1k to 1m"):
            make_config(tmp_path / "run", nginx=nginx)
    assert make_config(tmp_path / "run", nginx={"client_header_buffer_size": "1m"})
    # and numbers nginx takes at `nginx -t` and then cannot serve with (a billion connections:
    # every nginx worker failed its allocation; an outside check), or refuses
    for key, value in (("worker_connections", 10 ** 9), ("send_timeout_s", 10 ** 20),
                       ("listen_backlog", 10 ** 20), ("upstream_keepalive", 10 ** 20)):
        with pytest.raises(config.ConfigError, match=f"nginx.{key}: .*an integer from 1 to|"
                                                     f"nginx.{key}: .*whole seconds from 1"):
            make_config(tmp_path / "run", nginx={key: value})
    # as are as many connections made from the frontends' admission
    many = make_config(tmp_path / "run", frontends={"count": 64, "max_inflight": 100_000})
    with pytest.raises(render.RenderError, match="64 x 100000.*lower frontends.max_inflight"):
        render.render(many)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_missing_nginx_binary_names_the_key(tmp_path):
    cfg = make_config(tmp_path / "run", nginx={"binary": "no-such-nginx"})
    with pytest.raises(render.RenderError, match="nginx.binary"):
        render.render(cfg)


def test_socket_paths_over_the_unix_limit_name_the_key(tmp_path):
    cfg = make_config(tmp_path / ("x" * 100))
    with pytest.raises(render.RenderError, match="server.run_dir"):
        render.render(cfg)


def test_placeholders_and_quoting():
    with pytest.raises(render.RenderError, match="@nope@"):
        render.fill("a @nope@ b", {})
    assert render.environment({"A": "50%", "B": ""}) == 'A="50%%",B=""'
    assert render.command("/a b/python", "-m", "x") == "'/a b/python' -m x"
    # what supervisord would not read back as written (a value from the environment `up`
    # runs in: TORCHINDUCTOR_CACHE_DIR, CUDA_DEVICE_ORDER; the config's are checked at load)
    for value in ('say "hi"', "a\nb=c", "a ;b", "a #b", "'a", "a'"):
        with pytest.raises(render.RenderError, match=r"^environment A: .* cannot be passed"):
            render.environment({"A": value})
    assert render.environment({"A": "it's;a#b"}) == 'A="it\'s;a#b"'


def port_answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def wait_until(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_reaper_listens_for_every_exit_before_the_programs_start(tmp_path):
    cfg = make_config(tmp_path / "run")
    render.render(cfg)
    options = ServerOptions()
    options.configfile = str(supervisor_files.supervisord_conf(cfg))
    options.process_config(do_usage=False)
    pools = [g for g in options.process_group_configs if isinstance(g, EventListenerPoolConfig)]
    (pool,) = pools
    assert pool.name == "reaper"
    assert {e.__name__ for e in pool.pool_events} == {
        "ProcessStateExitedEvent", "ProcessStateStoppedEvent", "ProcessStateBackoffEvent",
        "ProcessStateFatalEvent", "SupervisorStoppingEvent"}  # the frontends drain with nginx
    assert pool.priority < min(g.priority for g in options.process_group_configs
                               if g is not pool)  # up first, down last
    (p,) = pool.process_configs
    assert p.command == f"{sys.executable} -m shmserve.reaper --config {cfg.run_dir}/config.json"
    assert p.stderr_logfile == f"{cfg.run_dir}/logs/reaper.log" and not p.redirect_stderr
    assert p.environment["PROMETHEUS_MULTIPROC_DIR"] == str(cfg.run_dir / "metrics")
    assert p.autorestart is RestartUnconditionally


def test_supervisord_runs_as_root_only_by_its_user_line(tmp_path, monkeypatch):
    """user=root as root (supervisord logged a CRIT line at every start without it), no user
    otherwise (a uid without a passwd entry, as a container may run, would be refused)."""
    for euid, want in ((0, "root"), (10001, None)):
        monkeypatch.setattr(render.os, "geteuid", lambda euid=euid: euid)
        cfg = make_config(tmp_path / f"run-{euid}")
        render.render(cfg)
        options = ServerOptions()
        options.configfile = str(supervisor_files.supervisord_conf(cfg))
        options.process_config(do_usage=False)
        assert options.configroot.supervisord.user == want


def test_supervisords_socket_has_a_password_kept_across_renders(tmp_path):
    """Made at the first render (without one supervisord logged a CRIT line at every start),
    private, the same at every later render: an apply writes a new file, which the running
    supervisord's socket does not take, so a new password would lock supervisorctl out."""
    cfg = make_config(tmp_path / "run")
    render.render(cfg)
    password = supervisor_files.password(cfg)
    assert password and len(password) >= 32
    assert supervisor_files.secret(cfg).stat().st_mode & 0o777 == 0o600
    render.render(make_config(tmp_path / "run", frontends={"count": 3}))  # an apply's render
    assert supervisor_files.password(cfg) == password
    options = ServerOptions()
    options.configfile = str(supervisor_files.supervisord_conf(cfg))
    options.process_config(do_usage=False)
    server, = options.configroot.supervisord.server_configs
    assert (server["username"], server["password"]) == ("shmserve", password)
    assert supervisor_files.password(make_config(tmp_path / "other")) is None  # none made
    # its file removed: the rendered file's, and the next render makes the file again with it
    supervisor_files.secret(cfg).unlink()
    assert supervisor_files.password(cfg) == password
    render.render(cfg)
    assert supervisor_files.secret(cfg).read_text().strip() == password


def test_nginx_logs_go_through_supervisord(tmp_path):
    """So they rotate like every other program's log (nginx.log under the run directory)."""
    cfg = make_config(tmp_path / "run")
    render.render(cfg)
    conf = render.nginx_conf(cfg).read_text()
    assert "error_log stderr warn;" in conf
    # Buffered as the Python processes' lines are (logging.flush_interval_ms), in writes no
    # larger than a pipe's atomic write.
    assert "access_log /dev/stdout shmserve_json buffer=4k flush=200ms;" in conf
    assert str(topology.log_dir(cfg)) not in conf


def test_nginx_access_lines_are_written_at_once_when_log_flushing_is_off(tmp_path):
    cfg = make_config(tmp_path / "run", logging={"flush_interval_ms": 0})
    render.render(cfg)
    assert "access_log /dev/stdout shmserve_json;" in render.nginx_conf(cfg).read_text()


def test_nginx_worker_processes_may_be_auto(tmp_path):
    cfg = make_config(tmp_path / "run", nginx={"worker_processes": "auto"})
    render.render(cfg)
    assert "worker_processes auto;" in render.nginx_conf(cfg).read_text()
    assert render._minfds(cfg) >= 4096
    with pytest.raises(config.ConfigError, match="nginx.worker_processes: .*auto or an integer"):
        make_config(tmp_path / "run2", nginx={"worker_processes": "lots"})


def test_logging_to_stdout_sends_every_programs_lines_to_supervisords_stdout(
        tmp_path, deployment, monkeypatch):
    """logging.stdout (a container's `kubectl logs`): /dev/stdout, which supervisord cannot
    rotate, for every program; `up` without --foreground refuses it (a daemon's stdout is
    /dev/null)."""
    cfg = make_config(tmp_path / "run", logging={"stdout": True})
    render.render(cfg)
    for name, (_, p) in programs(cfg).items():
        assert p.stdout_logfile == "/dev/stdout", name
        assert (p.stdout_logfile_maxbytes, p.stdout_logfile_backups) == (0, 0), name
    options = ServerOptions()
    options.configfile = str(supervisor_files.supervisord_conf(cfg))
    options.process_config(do_usage=False)
    (reaper,) = [p for g in options.process_group_configs if g.name == "reaper"
                 for p in g.process_configs]
    assert reaper.stderr_logfile == "/dev/stdout" and reaper.stderr_logfile_maxbytes == 0
    # supervisord's own log, still a file under the run directory: small (50 MB x 6 could
    # pass the Kubernetes overlay's 256Mi run volume, an outside check)
    assert options.logfile_maxbytes * (options.logfile_backups + 1) <= 32 << 20
    import argparse

    from shmserve import cli

    # The deployment fixture's environment (a run directory under tmp_path), with stdout on.
    monkeypatch.setenv("SHMSERVE__LOGGING__STDOUT", "true")
    with pytest.raises(cli.CliError, match="--foreground"):
        cli.up(argparse.Namespace(env=None, config=None, wait=True, foreground=False,
                                  timeout=None))


def test_nginx_sends_a_request_on_to_one_other_frontend_at_most(tmp_path):
    """A body that held its frontend until the hung kill went on to the next frontend, and to
    every one in turn (a security review): at most one other now; a frozen frontend's held
    requests are still served by another (tests/chaos)."""
    for count, want in ((1, 1), (2, 2), (8, 2)):
        cfg = make_config(tmp_path / f"run{count}", frontends={"count": count})
        render.render(cfg)
        conf = render.nginx_conf(cfg).read_text()
        assert f"proxy_next_upstream_tries {want};" in conf


def test_nginx_has_room_for_every_request_the_frontends_admit(tmp_path):
    """Each request in flight holds a client and an upstream connection, admitted or not: with
    4,096 worker connections and 2 x 1,024 admitted, a burst of ~2,000 got resets from nginx
    ("worker_connections are not enough") and never the frontends' 429."""
    def rendered(name, **overrides):
        cfg = make_config(tmp_path / name, **overrides)
        render.render(cfg)
        conf = render.nginx_conf(cfg).read_text()
        return int(re.search(r"worker_connections (\d+);", conf).group(1)), conf

    slack = 64 + nginx_options.CONNECTION_SLACK  # idle upstream keep-alive connections, listeners

    def room(held: int) -> int:  # nginx drains waiting connections at 1/16 free
        return math.ceil(held * 16 / 15) + 1

    connections, conf = rendered("default")
    assert connections == 16384 >= room(2 * (2 * 1024 + nginx_options.CLIENT_MARGIN) + slack)
    assert re.search(r"listen 127\.0\.0\.1:\d+ default_server backlog=4096;", conf)
    # 4 x 1,024 admitted, as --env prod: requests past admission hold two connections too (a
    # burst of 8,000 got ~315 resets with 16,384, and ~260 with 16,512: an outside check)
    prod = rendered("prod", frontends={"count": 4, "max_inflight": 1024})[0]
    assert prod == room(2 * (4 * 1024 + nginx_options.CLIENT_MARGIN) + slack) == 17614
    many = {"count": 8, "max_inflight": 2048}
    assert rendered("many", frontends=many)[0] == room(2 * (8 * 2048 + nginx_options.CLIENT_MARGIN)
                                                       + slack)
    split = rendered("split", frontends=many,
                     nginx={"worker_processes": 4, "worker_connections": 1000})[0]
    assert split == room(2 * (8 * 2048 + nginx_options.CLIENT_MARGIN) // 4 + slack)
    assert rendered("set", nginx={"worker_connections": 50000, "listen_backlog": 128})[0] == 50000



def test_programs_name_one_interpreter_whichever_of_its_names_ran_shmserve(tmp_path,
                                                                          monkeypatch):
    """pip writes into the `shmserve` script the name that ran it (`python -m pip`: python;
    the README's `.venv/bin/pip`: python3.11): every program's command changed with it, and the
    next `apply` replaced every worker and frontend while its dry run said nothing (an outside
    check). The directory's `python` names the same file: commands stay as they were."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python3.11").write_text("")
    (venv / "python").symlink_to("python3.11")
    (venv / "python3").symlink_to("python3.11")
    assert render.interpreter(str(venv / "python3.11")) == str(venv / "python")
    assert render.interpreter(str(venv / "python3")) == str(venv / "python")
    assert render.interpreter(str(venv / "python")) == str(venv / "python")
    other = tmp_path / "other" / "bin"  # a `python` that is another file: this one's own name
    other.mkdir(parents=True)
    (other / "python3.11").write_text("")
    (other / "python").write_text("")
    assert render.interpreter(str(other / "python3.11")) == str(other / "python3.11")
    cfg = make_config(tmp_path / "run")
    here = Path(sys.executable).parent
    commands = []
    for name in ("python", f"python{sys.version_info.major}.{sys.version_info.minor}"):
        assert (here / name).exists(), here  # a venv (or a system) has both names
        monkeypatch.setattr(sys, "executable", str(here / name))
        commands.append(render.render_supervisord(cfg, "/usr/sbin/nginx", "pw"))
    assert commands[0] == commands[1]
