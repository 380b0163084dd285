"""``shmserve``: render a deployment and drive its supervisord.

    shmserve up [--wait] [--timeout S] [--foreground]   render, clean stale state, start
    shmserve down                                        stop everything, clean up
    shmserve status [--watch [S]] [--count N] [--json]   processes, workers, throughput, memory
    shmserve restart frontends|workers|nginx|PROGRAM [--all-at-once]   rolling, no request lost
    shmserve apply [--dry-run]                           the config as it loads now, applied
                                                         one process at a time
    shmserve ctl ARGS...                                 supervisorctl with this deployment's -c
    shmserve config [--show-secrets] [--running]         the resolved config as JSON
    shmserve models                                      GET /admin/models
    shmserve reload NAME [SOURCE] [--revision R] [--variant V]   hot reload a model
    shmserve split NAME VARIANT=WEIGHT...                A/B weights of a model

``--env`` and ``--config`` (or SHMSERVE_ENV and SHMSERVE_CONFIG) choose the deployment for
every command: its run directory holds the rendered configs, sockets, logs and pid files. While
it runs, the other commands use the config it was started with (run_dir/config.json), not the
environment they are run in, so an override given to `up` need not be repeated.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from shmserve import (config, configview, models, nginxrun, processes, remote, render, state,
                      supervisor_files, tls, topology)
from shmserve.config import Config, ConfigError
from shmserve.prechecks import (CliError, check_fds, check_port, check_reachable,  # noqa: F401
                                check_shm, check_stdout, seconds)
from shmserve.startwait import log_sizes, wait_ready
from shmserve.status_cli import leftovers, status, unsupervised

def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # --config before the command, then after it: all merge in order (`--config A --config B`
    # kept B alone, silently: an outside check lost configs/gpu.yaml so)
    args.config = _joined(args.config_before, getattr(args, "config", None))
    del args.config_before
    if extra:
        # `reload NAME --revision R SOURCE`: argparse gives the optional positional SOURCE
        # nothing when an option comes between it and NAME, and leaves it over.
        if getattr(args, "source", None) == "" and len(extra) == 1 \
                and not extra[0].startswith("-"):
            args.source = extra[0]
        else:  # said with the command's usage, not the program's (an outside check)
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


# What a command interrupted (Ctrl-C) leaves behind, by the function that runs it.
INTERRUPTED = {
    "up": ": what it started keeps running (`shmserve status` shows it, `shmserve down` stops "
          "it)",
    "apply": " part way: the run directory holds the new config, which restarted programs "
             "start on; `shmserve apply` again goes on from there (run/apply.json keeps the "
             "config from before)",
    "restart": ": the programs restarted so far run on the rendered config, the others were "
               "not restarted (`shmserve status`); one it had stopped and not started yet is "
               "left stopped, and the next restart of its group (or `shmserve apply`) starts "
               "it (run/restart.json names it)",
    "reload": ": the reload may go on in the workers (`shmserve models` shows each revision)",
}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        return args.run(args)
    except (ConfigError, render.RenderError, CliError, remote.RemoteError, tls.TlsError) as exc:
        print(f"shmserve: {exc}", file=sys.stderr)
        return 2
    except PermissionError as exc:  # another user's deployment, or a file not ours
        print(f"shmserve: {exc.filename or exc}: permission denied (is this deployment, "
              "its server.run_dir, another user's?)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what was left, not a traceback
        print(f"\nshmserve: interrupted{INTERRUPTED.get(args.run.__name__, '')}",
              file=sys.stderr)
        return 130
    except BrokenPipeError:  # `shmserve config | head`: the reader left, nothing to say
        # Python's own recipe: stdout to /dev/null, so the flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _joined(*files: str | None) -> str | None:
    """Config file lists (each one or several joined by ':') as one, in order; None: none."""
    return os.pathsep.join(f for f in files if f) or None


class _JoinFiles(argparse.Action):
    """--config given again adds its file after the others, as a ':' list does."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, _joined(getattr(namespace, self.dest, None), values))


def _parser() -> argparse.ArgumentParser:
    env_help = "configs/ENV.yaml over base.yaml (default: SHMSERVE_ENV or dev)"
    config_help = ("an extra YAML file over those (or SHMSERVE_CONFIG); several, given again "
                   "or joined by ':', merge in order")
    # Before the command (`shmserve --config F up`, as users type it: an outside check found it
    # refused) or after it; --env after it wins, every --config merges in order (`parse`).
    # SUPPRESS: a command without them keeps the first's.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--env", default=argparse.SUPPRESS, help=env_help)
    common.add_argument("--config", default=argparse.SUPPRESS, action=_JoinFiles,
                        help=config_help)
    parser = argparse.ArgumentParser(
        prog="shmserve", description="Render a deployment and drive its supervisord.")
    parser.add_argument("--env", help=env_help)
    parser.add_argument("--config", dest="config_before", action=_JoinFiles, help=config_help)
    sub = parser.add_subparsers(required=True, metavar="COMMAND", dest="command")
    parser.commands = sub.choices  # each command's parser, by name (`parse`)

    def command(name: str, run: Callable[[argparse.Namespace], int],
                help: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, parents=[common], help=help, description=help)
        cmd.set_defaults(run=run)
        return cmd

    up_cmd = command("up", up, "render the run directory and start supervisord")
    up_cmd.add_argument("--wait", action="store_true",
                        help="wait until GET /ready answers 200, through nginx and from every "
                             "frontend")
    up_cmd.add_argument("--timeout", type=seconds, help="seconds --wait waits "
                        "(default: workers.ready_timeout_s)")
    up_cmd.add_argument("--foreground", action="store_true",
                        help="run supervisord in the foreground (containers)")
    command("down", down, "stop every process and remove sockets and shared memory")
    status_cmd = command("status", status, "each process's state and memory; per worker its "
                         "readiness, queue, throughput and memory (GET /ready, /metrics)")
    status_cmd.add_argument("--watch", nargs="?", type=float, const=2.0, metavar="SECONDS",
                            help="refresh every SECONDS (default 2) until Ctrl-C")
    status_cmd.add_argument("--count", type=_at_least_one, metavar="N",
                            help="with --watch: stop after N refreshes")
    status_cmd.add_argument("--json", action="store_true", help="one line of JSON (a line per "
                            "refresh with --watch): the same figures, unformatted")
    from shmserve.restarts import restart  # it imports this module's helpers

    restart_cmd = command("restart", restart, "restart a group one program at a time, each "
                          "ready before the next (nginx: a graceful configuration reload)")
    restart_cmd.add_argument("target", help="frontends | workers | nginx | a program name "
                             "(frontend-0, worker-1)")
    restart_cmd.add_argument("--all-at-once", action="store_true", help="restart a group's "
                             "programs together (faster; requests fail until they are ready)")
    restart_cmd.add_argument("--timeout", type=seconds, help="seconds to wait for each restarted "
                             "program to be ready (default: workers.ready_timeout_s)")
    from shmserve.apply import add_parser as add_apply  # it imports this module's helpers

    add_apply(command)
    ctl_cmd = command("ctl", ctl, "run supervisorctl against this deployment")
    ctl_cmd.add_argument("ctl_args", nargs=argparse.REMAINDER, metavar="ARGS")
    config_cmd = command("config", show_config, "print the resolved config as JSON, its "
                         "credentials (admin.token, auth.api_keys) as ***, and check its models "
                         "as `up` does")
    config_cmd.add_argument("--show-secrets", action="store_true",
                            help="print admin.token and auth.api_keys in clear")
    config_cmd.add_argument("--running", action="store_true",
                            help="the config the running deployment was started with "
                                 "(run/config.json), not the one the files and environment "
                                 "give now")
    command("models", remote.list_models, "each model's revision and loading state per worker "
            "(GET /admin/models, with admin.token)")
    reload_cmd = command("reload", remote.reload, "load new weights for a model on every "
                         "worker and switch to them without dropping a request")
    reload_cmd.add_argument("name", help="the model")
    reload_cmd.add_argument("source", nargs="?", default="", help="a model directory (under "
                            "model_roots) or package:NAME; default: the current one, re-read")
    reload_cmd.add_argument("--revision", default="", help="the new revision label (default: "
                            "a digest of the weights)")
    reload_cmd.add_argument("--variant", default="", help="the A/B variant to reload")
    split_cmd = command("split", remote.split, "set the A/B weights of a model with variants")
    split_cmd.add_argument("name", help="the model")
    split_cmd.add_argument("weights", nargs="+", metavar="VARIANT=WEIGHT")
    return parser


def _at_least_one(text: str) -> int:
    if not text.lstrip("+").isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def up(args: argparse.Namespace) -> int:
    cfg = config.from_args(args)
    try:
        with state.starting_or_stopping(cfg, "up", wait=False):
            code, log_starts = _start(args, cfg)
    except state.Busy as busy:
        if str(busy).startswith("`shmserve down`"):  # the holder's name (state.held)
            raise CliError(f"a `down` is stopping this deployment ({busy}, run_dir "
                           f"{cfg.run_dir}); run `up` again once it has finished") from None
        raise CliError(f"{busy} is starting this deployment (run_dir {cfg.run_dir})") from None
    if code is not None:
        return code
    timeout = args.timeout if args.timeout is not None else cfg.workers.ready_timeout_s
    return wait_ready(cfg, timeout, log_starts)


def _start(args: argparse.Namespace, cfg: Config) -> tuple[int | None, dict[str, int]]:
    """`up` until its supervisord runs: (its exit status, or None for `--wait` to wait, and
    where each program's log ended before the start)."""
    pid = supervisord_pid(cfg)
    if pid is not None and processes.shutting_down(cfg):
        # A shutdown `down` did not start (`ctl shutdown`, supervisord's SIGTERM); a `down`'s
        # own holds the up/down lock above
        raise CliError(f"supervisord (pid {pid}, run_dir {cfg.run_dir}) is shutting down; run "
                       "`up` again once it has exited")
    if pid is not None:
        raise CliError(f"already running (supervisord pid {pid}, run_dir {cfg.run_dir}); "
                       "`shmserve apply` takes the config as it loads now into it, one "
                       "process at a time (`restart` keeps the running one)")
    if args.wait and args.foreground:
        raise CliError("--wait and --foreground exclude each other")
    if cfg.logging.stdout and not args.foreground:
        raise CliError("logging.stdout: the programs' logs go to supervisord's stdout, which "
                       "only `up --foreground` keeps (a daemon's is /dev/null); use "
                       "--foreground (a container's command), or logging.stdout: false")
    if cfg.logging.stdout:
        check_stdout()
    if note := topology.unplaced_gpus(cfg):
        print(f"shmserve: note: {note}", file=sys.stderr)
    try:
        models.check(cfg, topology.worker_devices(cfg))  # before any process starts
    except models.ModelSourceError as exc:
        raise CliError(f"models: {exc}") from None
    leftovers = processes.kill_orphans(cfg)  # a SIGKILLed supervisord left its children
    if render.nginx_conf(cfg).exists():  # and its nginx, which holds that file open
        leftovers += nginxrun.kill_all(render.nginx_conf(cfg))
    if leftovers:
        print(f"shmserve: killed processes a dead supervisord left behind: {leftovers}")
        if drift := replaced_drift(cfg):
            print(f"shmserve: warning: the deployment they served ran another config "
                  f"({topology.resolved_config_path(cfg)}): {drift}; this one starts with the "
                  "config as it loads now (repeat that `up`'s overrides to keep them)",
                  file=sys.stderr)
    check_port(cfg)  # after those: this deployment's own leftovers may have held it
    check_shm(cfg)
    check_fds(cfg)
    check_reachable(cfg)
    render.render(cfg)  # only now: a refused `up` leaves the run directory as it was
    topology.record_sources(cfg, args.env, args.config)
    clean_stale(cfg, metrics=True)
    state.remove(cfg)  # reloads and splits of an earlier run: at start the config is the truth
    state.remove_marks(cfg)  # an earlier run's start and failed loads
    # ... and an apply it stopped part way: this start runs the config files as they are (its
    # marker made status say "stopped part way" and the next apply plan to finish it, after
    # `down` and `up`: an outside check)
    topology.apply_marker_path(cfg).unlink(missing_ok=True)
    topology.restart_marker_path(cfg).unlink(missing_ok=True)  # (the same for a restart's)
    argv = [tool("supervisord"), "-c", str(supervisor_files.supervisord_conf(cfg))]
    log_starts = log_sizes(cfg)
    if args.foreground:
        os.execv(argv[0], [*argv, "--nodaemon"])
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise CliError(f"supervisord did not start: {(done.stderr or done.stdout).strip()}")
    _wait_for(lambda: supervisord_pid(cfg) is not None and supervisor_files.socket(cfg).exists(),
              10.0, f"supervisord did not come up; see {topology.log_dir(cfg)}/supervisord.log")
    print(f"shmserve: started (run_dir {cfg.run_dir})")
    return (None if args.wait else 0), log_starts


def down(args: argparse.Namespace) -> int:
    cfg = processes.deployment(args)
    with state.starting_or_stopping(cfg, "down", wait=True):
        return _down(cfg)


def _down(cfg: Config) -> int:
    pid = supervisord_pid(cfg)
    left = leftovers(cfg) if pid is None else []  # a killed supervisord's, stopped below
    if pid is not None:
        processes.settle_spawns(cfg)  # a signal before a program's exec is lost
        subprocess.run(ctl_argv(cfg, "shutdown"), check=False, stdout=subprocess.DEVNULL)
        # supervisord stops its three groups one after another, each within stopwaitsecs.
        limit = 2 * render.stopwaitsecs(cfg) + render.frontend_stopwaitsecs(cfg) + 10
        _wait_for(lambda: not processes.alive(pid), limit,
                  f"supervisord (pid {pid}) still runs after {limit} s")
        print("shmserve: stopped")
    if render.nginx_conf(cfg).exists():
        nginxrun.kill_all(render.nginx_conf(cfg))
    processes.kill_orphans(cfg)
    clean_stale(cfg, metrics=False)
    # (server.run_dir a file, or under one: no deployment's files there; unlink's
    # NotADirectoryError was a traceback, an outside check)
    if cfg.run_dir.is_dir():
        state.remove_reload_locks(cfg)  # after the frontends, their holders, are gone
        state.remove_marks(cfg)
        # A SIGKILLed supervisord's pid file and control socket (a clean exit removes both)
        supervisor_files.supervisord_pidfile(cfg).unlink(missing_ok=True)
        supervisor_files.socket(cfg).unlink(missing_ok=True)
    if pid is None:
        print(f"shmserve: supervisord was not running (run_dir {cfg.run_dir}); stopped the "
              f"processes it had left running: pids {', '.join(map(str, left))}" if left else
              f"shmserve: {processes.not_running(cfg)}")
    return 0


def ctl(args: argparse.Namespace) -> int:
    rest = deployment_flags(args, args.ctl_args)
    cfg = processes.deployment(args)
    if rest[:1] == ["tail"] and cfg.logging.stdout:
        # supervisorctl would read /dev/stdout: an error, nothing, or another program's lines
        raise CliError("logging.stdout: the programs' lines go to supervisord's stdout (the "
                       "container's: `kubectl logs`, `docker logs`), not to files to tail; "
                       "`ctl maintail` tails supervisord's own log")
    if rest[:1] != ["help"] and supervisord_pid(cfg) is None:  # (supervisorctl: its socket URL)
        if message := unsupervised(cfg):  # a killed supervisord's programs serve on
            print(f"shmserve: {message}", file=sys.stderr)
            return 1  # as `status`
        print(f"shmserve: {processes.not_running(cfg)}", file=sys.stderr)
        return 3  # as `status`
    return subprocess.run(ctl_argv(cfg, *rest), check=False).returncode


def deployment_flags(args: argparse.Namespace, argv: list[str]) -> list[str]:
    """Take --env/--config out of a pass-through argv (`ctl stop workers:* --config f`) into args;
    supervisorctl's commands have no such options."""
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        name, eq, value = arg.partition("=")
        if name in ("--env", "--config"):
            value = value if eq else next(it, None)
            if value is None:
                raise CliError(f"{name} needs a value")
            setattr(args, name[2:], _joined(args.config, value) if name == "--config" else value)
        else:
            rest.append(arg)
    return rest


def show_config(args: argparse.Namespace) -> int:
    """Print the resolved config, then check its models as `up` would before starting (sources,
    weights' headers, pinned devices, variants, dtypes): exit 2 naming the problem."""
    loaded = config.from_args(args)
    running = processes.running_config(loaded)
    if args.running:
        if running is loaded:
            raise CliError(processes.not_running(loaded))
        cfg = running
    else:
        cfg = render.resolved(loaded)
        if running is not loaded and running.to_json() != cfg.to_json():
            print("shmserve: note: a deployment runs from this run_dir with another config; this "
                  "is the config as the files and environment give it now (`shmserve config "
                  "--running` for the running one)", file=sys.stderr)
    print((cfg if args.show_secrets else configview.redacted(cfg)).to_json(), flush=True)
    try:
        models.check(cfg, topology.worker_devices(cfg))
    except models.ModelSourceError as exc:
        raise CliError(f"models: {exc}") from None
    return 0


def replaced_drift(cfg: Config) -> str | None:
    """How `cfg` differs from the config the deployment in its run directory last ran
    (run/config.json), or None."""
    try:
        old = config.load_resolved(topology.resolved_config_path(cfg))
    except (OSError, ValueError):  # none, or another version's
        return None
    return "; ".join(configview.differences(render.resolved(old), render.resolved(cfg))) or None


def clean_stale(cfg: Config, metrics: bool) -> None:
    """Remove what killed processes left: shared memory (this deployment's, and any other's
    whose creator is gone), socket files, (metrics files)."""
    from shmserve import arena  # numpy: imported by the commands that need it only

    arena.sweep(topology.shm_prefix(cfg))
    orphans = arena.sweep_orphans()
    if orphans:
        print(f"shmserve: removed shared memory that killed processes left: {', '.join(orphans)}")
    dirs = [topology.socket_dir(cfg)] + ([topology.metrics_dir(cfg)] if metrics else [])
    for directory in dirs:
        for path in directory.glob("*") if directory.is_dir() else ():
            if not path.is_dir():
                path.unlink(missing_ok=True)


supervisord_pid = processes.supervisord_pid


def tool(name: str) -> str:
    """supervisord/supervisorctl: the one beside this Python (the venv's) first."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if os.access(beside, os.X_OK) else shutil.which(name)
    if found is None:
        raise CliError(f"{name} not found; install shmserve's dependencies (scripts/install)")
    return found


def ctl_argv(cfg: Config, *args: str) -> list[str]:
    return [tool("supervisorctl"), "-c", str(supervisor_files.supervisord_conf(cfg)), *args]


def _wait_for(condition: Callable[[], bool], timeout: float, error: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise CliError(error)
        time.sleep(0.1)


if __name__ == "__main__":
    # `python -m shmserve.cli` runs this file as __main__; shmserve.restarts imports
    # shmserve.cli, a second copy whose CliError this copy's main would not catch. Run the
    # imported module's main, so there is one.
    from shmserve import cli

    sys.exit(cli.main())
