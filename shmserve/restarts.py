"""`shmserve restart`: a group one program at a time, each ready again before the next; nginx
reloaded in place; one program, waited for; or supervisorctl's restart of a whole group."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from shmserve import (apikeys, config, configview, layers, models, processes, render,
                      restart_record, state, topology, versions)
from shmserve.probes import frontend_ready, load_failure, ready_in, seen_workers
from shmserve.cli import CliError, ctl_argv
from shmserve.startwait import failed_start, print_log_tails, process_info, restart_loop
from shmserve.config import Config, ConfigError

GROUPS = {"frontends": "frontends:*", "workers": "workers:*", "nginx": "nginx"}


def restart(args: argparse.Namespace) -> int:
    cfg = processes.deployment(args)
    if processes.supervisord_pid(cfg) is None:
        raise CliError(processes.not_running(cfg))
    try:
        with state.operating(cfg, f"restart {args.target}"):
            return _restart(args, cfg)
    except state.Busy as busy:
        raise CliError(f"{busy} is restarting programs of this deployment; wait for it to "
                       "end") from None
    except CliError:
        if processes.stopping(cfg, 1.0):  # `down` meanwhile: not supervisorctl's
            raise CliError("the deployment stopped (`shmserve down`?) during the restart; "
                           "nothing of it runs now") from None  # "abnormal termination"
        raise


def _restart(args: argparse.Namespace, cfg: Config) -> int:
    """A group one program at a time, each ready again before the next goes, so the others
    serve meanwhile (nginx moves a refused request to the next frontend; a frontend routes
    around a stopped worker); nginx itself reloads its configuration in place (SIGHUP: new
    workers start, the old ones finish their requests). A single program is restarted and
    waited for. `--all-at-once`: supervisorctl's restart of the whole group, then each program
    waited for as above (it returned once supervisord had started them, and exited 0 while
    workers that could not load crash-looped)."""
    from shmserve.apply import apply_state

    applying = apply_state(cfg)  # (one running holds the operation lock: refused above)
    if applying == "stopped_part_way":
        say(f"shmserve: warning: an apply stopped part way ({topology.apply_marker_path(cfg)}):"
            " the programs restarted now start on the config it was applying (config.json "
            "beside it); "
            "`shmserve apply` finishes it, or, with the config put back, undoes it",
            sys.stderr)
    elif not getattr(args, "unloadable", False) and (drift := config_drift(args, cfg)):
        say(f"shmserve: warning: {drift}", sys.stderr)
    target = restart_target(args.target)
    timeout = args.timeout if args.timeout is not None else cfg.workers.ready_timeout_s
    if target == "nginx":
        from shmserve.nginx_reload import check_nginx_conf, reload_nginx  # (it imports this)

        check_nginx_conf(cfg)  # restarted on a file nginx refuses, nginx stayed down
        if not args.all_at_once:
            return reload_nginx(cfg)
    group, _, name = target.partition(":")
    if group == "frontends":  # they read auth.api_keys_file as they start: one that does not
        try:  # load would stop each restarted frontend (deployment() reads the config without)
            apikeys.api_keys(cfg)
        except ConfigError as exc:
            raise CliError(f"{exc}: a frontend restarted now would not start; mend it first")
    infos = process_info(cfg)
    programs = [p["name"] for p in infos if p["group"] == group]
    if group in ("frontends", "workers") and name != "*" and name not in programs:
        raise CliError(f"no program {args.target!r}; this deployment has "
                       f"{', '.join(programs) or 'none'} in {group}")
    if not programs:  # neither a group nor a program: supervisorctl would say so twice, exit 1
        raise CliError(f"no group or program {args.target!r}; restart frontends, workers, "
                       f"nginx or one of {', '.join(sorted(p['name'] for p in infos))}")
    if group in ("frontends", "workers"):
        # A program supervisord runs that run/config.json no longer has: an apply that removes
        # it is running or stopped part way (it would be waited for as a program it has no
        # socket or device for).
        count = cfg.frontends.count if group == "frontends" else len(topology.worker_devices(cfg))
        configured = {f"{group[:-1]}-{i}" for i in range(count)}
        kind = group if count != 1 else group[:-1]
        if extra := sorted(set(programs if name == "*" else [name]) - configured):
            raise CliError(f"{', '.join(extra)} run{'s' * (len(extra) == 1)} but the running "
                           f"config (run/config.json) has {count} {kind}: an apply that "
                           "removes them is running or stopped part way; `shmserve apply` "
                           "finishes it")
        if change := versions.protocol_change(cfg):  # an upgrade: restart all together
            raise CliError(change)
    # A group's programs stopped by a command (`shmserve ctl stop`) stay stopped: restarting
    # the group started them again. Named alone, a program is restarted whatever its state.
    # One stopped by a restart killed part way (between its stop and its start) is not an
    # operator's: restarted with the others (restart_record).
    left_stopped = []
    if name == "*" and group in ("frontends", "workers"):
        resumed = restart_record.stopped_by_restart(
            cfg, [p for p in infos if p["group"] == group])
        if resumed:
            say(f"shmserve: {restart_record.said(cfg, resumed)} with the rest")
        left_stopped = sorted(p["name"] for p in infos if p["group"] == group
                              and p["statename"] == "STOPPED" and p["name"] not in resumed)
    if left_stopped:
        programs = [p for p in programs if p not in left_stopped]
        say(f"shmserve: {', '.join(left_stopped)} {'is' if len(left_stopped) == 1 else 'are'} "
            f"stopped (a stop command): left stopped (`shmserve ctl start {group}:NAME` starts "
            "one)")
        if not programs:
            return 0
    lone = lone_models(cfg, programs if name == "*" else [name]) if group == "workers" else {}
    if warning := restart_gap(group, name, programs, args.all_at_once, lone, left_stopped):
        say(f"shmserve: warning: {warning}", sys.stderr)
    if group not in ("frontends", "workers"):
        return run_ctl(cfg, "restart", target)
    if name != "*":
        programs = [name]
    if args.all_at_once:  # together, then each waited for as a rolling restart waits
        named = [f"{group}:{p}" for p in programs] if left_stopped else [target]
        restart_record.begin(cfg, [f"{group}:{p}" for p in programs])
        if code := run_ctl(cfg, "restart", *named):
            return code
        restart_record.end(cfg)
        pids = {p["name"]: p["pid"] for p in process_info(cfg)}
        for program in sorted(programs):
            wait_until_ready(cfg, group, program, pids.get(program, 0), timeout, rest="")
        return 0
    for program in sorted(programs):
        restart_one(cfg, group, program, timeout)
    return 0


def say(text: str, stream=None) -> None:
    """A line of progress (stdout) or warning (stderr). A reader that went away (`restart
    workers | head -1`) must not stop a rolling restart half way, as the BrokenPipeError did:
    the rest of what it would have read goes to /dev/null."""
    stream = sys.stdout if stream is None else stream
    try:
        print(text, file=stream, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def config_drift(args: argparse.Namespace, running: Config,
                 environ: Mapping[str, str] | None = None) -> str | None:
    """What this command asks for that the running deployment does not run, which restart
    keeps (restarted programs read run/config.json; counts are supervisord's, fixed at `up`):
    the overrides given now (the --config files, SHMSERVE__ variables) laid over the running
    config, and config files edited since `up`. Overrides given to `up` and not repeated now
    are not differences: commands act on the deployment as it was started."""
    environ = os.environ if environ is None else environ
    path = topology.resolved_config_path(running)
    try:
        tree = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # no readable run/config.json (another version wrote it, say)
    try:
        now = render.resolved(config.from_tree(layers.overridden(tree, args.config, environ)))
    except ConfigError as exc:
        return f"the overrides given now are invalid ({exc}); restarting with the running config"
    changed = configview.differences(render.resolved(running), now)
    # Files this command names: --config or SHMSERVE_CONFIG's, and an env's file when --env or
    # SHMSERVE_ENV names one (without, `dev` is no choice of this command: `up --env prod`
    # followed by a bare restart changes nothing).
    named = layers.file_layers(args.env, args.config, environ)[
        1 if args.env or environ.get("SHMSERVE_ENV") else 2:]
    edited, new = files_since_up(running, named)
    if not changed and not edited and not new:
        return None
    said = []
    if changed:
        said.append(f"the overrides given now differ from the config this deployment runs "
                    f"({path}): {'; '.join(changed)}")
    if edited:
        said.append(f"config files edited or removed since `up` (or the last apply) read them: "
                    f"{', '.join(edited)}")
    if new:
        said.append(f"config files the running config was not read from (at `up`, or the "
                    f"last apply): {', '.join(new)}")
    return (f"{'. '.join(s[0].upper() + s[1:] for s in said)}. `restart` keeps the running "
            "config; to apply the new one: `shmserve apply` (with the same overrides; "
            "`apply --dry-run` lists the keys that differ)")


def files_since_up(running: Config, given: list[Path]) -> tuple[list[str], list[str]]:
    """(the config files `up` read whose content differs now, or that are gone; the files
    `given` to this command that `up` did not read). Neither for a deployment whose `up` kept
    no digests (an older version's)."""
    recorded = topology.config_files(running)
    if recorded is None:
        return [], []
    now = layers.digests([Path(p) for p in recorded])
    edited = [p for p, digest in recorded.items() if now.get(p) != digest]
    new = [str(f.resolve()) for f in given if f.is_file() and str(f.resolve()) not in recorded]
    return edited, new


def lone_models(cfg: Config, restarted: list[str]) -> dict[str, list[str]]:
    """The models (A/B arms as MODEL@VARIANT) each of the `restarted` workers is the only one
    to load (models[].devices), by program name: they go unserved while it restarts."""
    devices = topology.worker_devices(cfg)
    loads = [{u.name for u in models.hosted(cfg, devices, i)} for i in range(len(devices))]
    lone = {}
    for program in restarted:
        i = int(program.removeprefix("worker-"))
        others = set().union(*(names for j, names in enumerate(loads) if j != i))
        if only := sorted(loads[i] - others):
            lone[program] = only
    return lone


def gap_of(group: str) -> str | None:
    """What clients see while no program of `group` serves (None: nginx, reloaded in place)."""
    return {"workers": "requests wait for a worker (frontends.no_worker_wait_s) and are "
                       "answered 503 after that, until one is ready again",
            "frontends": "nginx answers 502 until one is ready again"}.get(group)


def restart_gap(group: str, name: str, programs: list[str], all_at_once: bool,
                lone: dict[str, list[str]] | None = None,
                stopped: Sequence[str] = ()) -> str | None:
    """What a restart of `name` ('*': all) in `group` (whose programs are `programs`, besides
    those `stopped` by a command) leaves unserved, or None when the others serve meanwhile.
    `lone`: lone_models of the restarted workers."""
    gap = gap_of(group)
    if gap is None:
        return None
    if all_at_once and (name == "*" or len(programs) == 1):
        return f"{group} restart all at once: {gap} (without --all-at-once, one at a time)"
    if len(programs) == 1 and stopped:
        return (f"{programs[0]} is the only program of {group} running ({', '.join(stopped)} "
                f"stopped): {gap}")
    if len(programs) == 1:
        return (f"{programs[0]} is the only program in {group}: {gap}; with two or more, "
                f"{group} restart without a gap")
    if lone:
        which = "; ".join(f"{', '.join(names)} only on {program}"
                          for program, names in sorted(lone.items()))
        return (f"some models have no other worker ({which}): while their worker restarts, "
                f"{gap.replace('requests', 'requests for them', 1)}, and GET /ready is 503; "
                "pin them to two or more workers (models[].devices) to restart without a gap")
    return None


def run_ctl(cfg: Config, *args: str) -> int:
    """A supervisorctl command whose output is the user's; its exit status. In a process group
    of its own: a Ctrl-C reaches this process alone, whose subprocess.run then ends it (a
    restart interrupted, as before), not supervisorctl too, whose own KeyboardInterrupt
    traceback showed under `shmserve: interrupted`."""
    return subprocess.run(ctl_argv(cfg, *args), check=False, process_group=0).returncode


def ctl(cfg: Config, *args: str) -> None:
    """A supervisorctl command that must succeed (a CliError with its output otherwise)."""
    done = subprocess.run(ctl_argv(cfg, *args), check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise CliError(f"supervisorctl {' '.join(args)} failed: "
                       f"{(done.stdout + done.stderr).strip()}")


def restart_one(cfg: Config, group: str, program: str, timeout: float) -> None:
    """Restart one frontend or worker and wait until it serves again: a frontend answers
    GET /ready with 200 on its own socket; a worker, under its new pid, is ready in every
    frontend's GET /ready (each learns it from the worker's heartbeats). A worker waits first
    for the other workers that are loading (restarted by hand or by supervisord meanwhile):
    stopped beside one still loading, requests found no ready worker (an outside check)."""
    if group == "workers":
        wait_for_others(cfg, int(program.rpartition("-")[2]), timeout)
    restart_record.begin(cfg, [f"{group}:{program}"])
    ctl(cfg, "restart", f"{group}:{program}")
    restart_record.end(cfg)
    pid = next((p["pid"] for p in process_info(cfg) if p["name"] == program), 0)
    wait_until_ready(cfg, group, program, pid, timeout,
                     rest=f"; the rest of the {group} were left as they are")


def wait_until_ready(cfg: Config, group: str, program: str, pid: int, timeout: float,
                     rest: str, done: str = "restarted") -> None:
    """Until `program`, restarted (`done`: or started, by apply) as process `pid`, serves
    again; a CliError (its logs said) when it exits or loops instead, or is not ready within
    `timeout`."""
    frontends = [str(topology.frontend_socket(cfg, i)) for i in range(cfg.frontends.count)]
    index = int(program.rpartition("-")[2])
    status: list[str | None] = [None]  # a frontend's, as last read
    failed: list[tuple[int, str] | None] = [None]  # (pid, error): a process started failed

    def ready() -> bool:
        if group == "frontends":  # also one whose 503 no wait mends (a model loads nowhere)
            status[0] = frontend_ready(frontends[index])
            return status[0] is not None
        seen = [seen_workers(path) for path in frontends]
        started = {pid, *watch.pids.get(program, [])}
        failed[0] = next((failure for workers in seen if workers is not None
                          if (failure := load_failure(workers, index, started))), None)
        return all(workers is not None and ready_in(workers, index, pid) for workers in seen)
    say(f"shmserve: {done} {program} (pid {pid}); waiting until it is ready")
    deadline = time.monotonic() + timeout
    watch = processes.StartWatch()
    while not ready():
        if failed[0] is not None:  # it exits and starts again, later each time, as it is
            raise CliError(f"{failed_start(cfg, program, *failed[0])}{rest}")
        if processes.supervisord_pid(cfg) is None:  # `down` meanwhile: it waited out its
            # timeout, then blamed the program (an outside check)
            raise CliError(f"the deployment stopped (`shmserve down`?) while {program} "
                           "started; nothing of it runs now")
        infos = process_info(cfg)
        if watch.see([p for p in infos if p["name"] == program]):
            raise CliError(f"{restart_loop(cfg, program, watch.pids[program])}{rest}")
        states = {p["name"]: p["statename"] for p in infos}
        if states.get(program) in ("FATAL", "BACKOFF", "EXITED"):  # it exited: say why
            raise CliError(f"{restart_loop(cfg, program, watch.pids.get(program) or [pid])}"
                           f"{rest}")
        if time.monotonic() > deadline:
            print_log_tails(cfg)
            raise CliError(f"{program} not ready ({states.get(program)}) after restarting"
                           f"{rest}; logs in {topology.log_dir(cfg)}")
        time.sleep(0.2)
    # A worker's models only: a frontend's index names no worker (frontend-1 was blamed for
    # worker-1's unloaded models, so an apply removing a model that fails there stopped).
    without = [f"{u['model']} ({u['error']})" for path in frontends[:1] if group == "workers"
               for u in ((seen_workers(path) or {}).get(index) or {}).get("unloaded") or []]
    if without:  # the next worker would fail them too: its other models alone are served
        raise CliError(f"{program} is ready without {'; '.join(without)}: its load failed; "
                       f"the worker tries again by itself{rest}")
    if (status[0] or "").startswith("failing"):
        say(f"shmserve: warning: {program} serves, and its GET /ready says failing: a model "
            f"loads on no worker (not loaded: {status[0].partition(': ')[2]}; `shmserve "
            "status` says why)", sys.stderr)
    say(f"shmserve: {program} ready")


def loading_workers(cfg: Config, index: int) -> list[int]:
    """The workers other than `index` that supervisord runs (or starts) and that the first
    frontend that answers does not see ready under that pid: loading, or still importing
    before their first heartbeat. One that exited (BACKOFF, FATAL) is not among them; nor is
    any when no frontend answers."""
    for i in range(cfg.frontends.count):
        seen = seen_workers(str(topology.frontend_socket(cfg, i)))
        if seen is None:
            continue
        return [int(other) for info in process_info(cfg)
                if info["group"] == "workers"
                and (other := info["name"].removeprefix("worker-")).isdigit()
                and int(other) != index and info["statename"] in ("STARTING", "RUNNING")
                and not ready_in(seen, int(other), info["pid"])]
    return []


def wait_for_others(cfg: Config, index: int, timeout: float) -> None:
    """Until no other worker is loading, or `timeout` (then it goes on, saying so)."""
    loading = loading_workers(cfg, index)
    if not loading:
        return
    names = ", ".join(f"worker-{i}" for i in loading)
    say(f"shmserve: {names} {'is' if len(loading) == 1 else 'are'} loading: waiting until "
        f"ready before restarting worker-{index}")
    deadline = time.monotonic() + timeout
    while loading_workers(cfg, index):
        if time.monotonic() > deadline:
            say(f"shmserve: warning: {names} still not ready after {timeout:g} s; restarting "
                f"worker-{index} anyway", sys.stderr)
            return
        time.sleep(0.2)


def restart_target(name: str) -> str:
    """supervisorctl's name for a group or a program: frontend-1 is frontends:frontend-1."""
    if name in GROUPS:
        return GROUPS[name]
    if name.startswith("frontend-"):
        return f"frontends:{name}"
    if name.startswith("worker-"):
        return f"workers:{name}"
    return name
