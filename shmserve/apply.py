"""`shmserve apply`: the config as the files and the environment give it now (what `up` would
start) applied to the running deployment one process at a time, so that the others serve
meanwhile and no request is refused (with two or more frontends, and every model on two or more
workers, as for a rolling restart): counts of frontends and workers, batching, limits, nginx's
settings, models.

The steps, each waited for before the next:

1. workers the new config adds start (they load while the rest goes on);
2. the workers it keeps restart one at a time when a key a worker reads changed, or their
   program did (devices, threads, logs), each ready in every frontend before the next;
3. frontends it adds start, each ready on its own socket;
4. the frontends it keeps restart one at a time when a key a frontend reads changed (the set of
   workers among them: a frontend knows the workers from its config), each ready;
5. nginx re-reads its configuration (SIGHUP) when it changed: the frontends it balances over,
   limits, rate limits; its old workers finish their requests;
6. frontends the new config drops stop, draining, once nginx no longer sends them requests;
7. workers it drops stop, draining, once every frontend sees the new ones ready;
8. the reaper restarts when the programs changed (it names every program).

What restarts, and in which order, is decided in shmserve.apply_plan. supervisord changes a
group only whole (`update` restarts every frontend when one is added), so processes are added,
replaced and removed one by one through shmserve.supervisor_rpc, after the run directory was
rendered again. An apply that stops part way (a worker that cannot load the
new model) leaves `run/apply.json`, the config from before it: `apply` again (after fixing the
config) goes on from there, so no step is skipped because run/config.json already says the new
config. The record names the programs the apply has reached (`reached`): one that crashes
before the apply reaches it starts again on the config it ran (shmserve.program_config), not on
the new config.json out of the order above.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import time
import xmlrpc.client
from typing import Iterator

from shmserve import (config, configview, models, moves, processes, program_config,
                      render, restart_record, state, tls, topology, versions)
from shmserve.apply_sources import left_out
from shmserve.apply_plan import (FIXED, Plan, by_counts, forget_overridden, index_of, nginx_differs,
                                 plan, reloads_held, warn_gaps)
from shmserve.prechecks import CliError, check_fds, check_reachable, check_shm, seconds
from shmserve.config import Config
from shmserve.nginx_reload import reload_nginx
from shmserve.restarts import ctl, say, wait_until_ready
from shmserve.startwait import process_info

def apply(args: argparse.Namespace) -> int:
    new = render.resolved(config.from_args(args))
    if processes.supervisord_pid(new) is None:
        raise CliError(processes.not_running(new) + "; `shmserve up` starts it")
    with exclusive(new):
        try:
            return _apply(args, new)
        except (CliError, OSError, xmlrpc.client.Fault) as exc:
            shutdown = "SHUTDOWN_STATE" in str(exc)  # supervisord stopping its programs
            if processes.stopping(new, 5.0 if shutdown else 0.0):  # `down` meanwhile: its
                raise CliError("the deployment stopped (`shmserve down`?) during the apply; "
                               "nothing of it runs now, and `shmserve up` starts the config "
                               "files as they are") from None  # traceback (an outside check)
            raise


def running_now(cfg: Config) -> bool:
    """Whether an apply runs on this deployment now (its lock is held; no file, none ever
    ran: status and restart create nothing)."""
    if not _lock_path(cfg).exists():
        return False
    try:
        with state.held(_lock_path(cfg), "apply"):
            return False
    except state.Busy:
        return True


APPLY_STATES = {
    "running": "`shmserve apply` is running on this deployment: programs restart one at a time",
    "stopped_part_way": "an apply stopped part way (run/apply.json, under server.run_dir): "
    "programs may run the config from before it beside the one it was applying, which is "
    "what this shows (run/config.json: its port, its programs); `shmserve apply` finishes it, "
    "or, with the config put back, undoes it",
}


def apply_state(cfg: Config) -> str | None:
    """An apply running now, or one that stopped part way (a key of APPLY_STATES), or None."""
    if running_now(cfg):
        return "running"
    return "stopped_part_way" if topology.apply_marker_path(cfg).exists() else None


def _lock_path(cfg: Config):
    return cfg.run_dir / "apply.lock"


@contextlib.contextmanager
def exclusive(cfg: Config) -> Iterator[None]:
    """One apply at a time on a deployment: two would add, stop and restart the same programs
    from two plans."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(state.held(_lock_path(cfg), "apply"))
        except state.Busy:
            raise CliError("another `shmserve apply` runs on this deployment; wait for it "
                           "to end") from None
        try:
            stack.enter_context(state.operating(cfg, "apply"))
        except state.Busy as busy:
            raise CliError(f"{busy} is restarting programs of this deployment; wait for it "
                           "to end") from None
        yield


@contextlib.contextmanager
def _refused_unchanged() -> Iterator[None]:
    """A refusal of the checks before anything changes says so: the changes were listed."""
    try:
        yield
    except (CliError, tls.TlsError) as exc:
        raise CliError(f"{exc} (nothing was applied)") from None


def _apply(args: argparse.Namespace, new: Config) -> int:
    running = processes.running_config(new)
    marker = topology.apply_marker_path(running)
    old, attempted, reached = running, [], {}
    if marker.exists():
        saved = json.loads(marker.read_text())
        reached = saved.get("reached", {})  # program -> the attempt it started on
        old = config.from_tree(saved["from"])
        attempted = [render.resolved(config.from_tree(tree)) for tree in saved["attempts"]]
        say("shmserve: an earlier apply stopped part way; applying from the config before it")
    old = render.resolved(old)
    fixed = [line for line in configview.differences(old, new) if line.startswith(FIXED)]
    if fixed:
        raise CliError(f"{'; '.join(fixed)}: set when supervisord starts; `shmserve down`, then "
                       "`shmserve up` to change it")
    changes = configview.differences(old, new)
    resumed = marker.exists()
    # The same config, but nginx.conf as this shmserve renders it is not the running one: an
    # upgrade changed the template (an outside check: after one, apply said "nothing to apply"
    # and the old rules ran on, `restart nginx` reloading the old file)
    template = not changes and not resumed and render.render_nginx(new) != \
        render.nginx_conf(new).read_text()
    if not changes and not resumed and not template:  # resumed: programs it added may run
        say("shmserve: nothing to apply: the running deployment has this config")
        return 0
    if change := versions.protocol_change(old):  # an upgrade: not one program at a time
        raise CliError(change)
    # Said before the checks: a refusal's reason may be a change the operator did not mean
    # (an override of `up`'s left out, `--env prod` forgotten).
    for warning in left_out(running, args.env, args.config, os.environ,
                            configview.changed_keys(old, new)):
        say(f"shmserve: warning: {warning}")
    finishing = " (finishing the earlier apply)" if resumed else ""
    # not "applying": the checks below may refuse it yet (an outside check read a refusal's
    # "applying:" and its differences as done)
    say(f"shmserve: {'would apply' if args.dry_run else 'changes'}{finishing}:\n"
        + "\n".join(f"  {line}" for line in changed(old, new, attempted) or
                     ["no key: nginx.conf as this shmserve renders it differs from the running "
                      "one (an upgrade): nginx reloads" if template else
                      "no key: the earlier apply's programs started or stopped"]))
    with _refused_unchanged():
        try:
            models.check(new, topology.worker_devices(new))
        except models.ModelSourceError as exc:
            raise CliError(f"models: {exc}") from None
        tls.check(new)  # a dry run too: an encrypted key was refused by the real apply alone
        moves.check(old, new, args.move, args.dry_run, say)
        check_shm(new)
        check_fds(new)  # as `up` warns
        check_reachable(new)
    with processes.supervisor(new) as proxy:
        try:
            proxy.shmserve.getAPIVersion()
        except xmlrpc.client.Fault:
            raise CliError("this deployment's supervisord was started by an older shmserve, "
                           "without `apply`: `shmserve down`, then `shmserve up`") from None
        running_now = [f"{p['group']}:{p['name']}" for p in
                       proxy.supervisor.getAllProcessInfo()] if args.dry_run else []
    if args.dry_run:
        steps = plan(old, new, by_counts(old, new, running_now), attempted)
        steps.nginx = nginx_differs(old, attempted, new, render.nginx_conf(new).read_text())
        warn_gaps(old, new, steps)  # as the run will (a dry run said nothing of them)
        forget_overridden(old, new, dry_run=True)
        say("shmserve: steps (and any program whose environment or logs change restarts "
            "too):\n" + "\n".join(steps.lines()))
        say("shmserve: --dry-run: nothing changed")
        return 0
    with reloads_held(old, new):
        earlier = marker.read_text() if resumed else None
        marker.write_text(json.dumps({"from": json.loads(old.to_json()), "attempts": [
            *(json.loads(a.to_json()) for a in attempted), json.loads(new.to_json())],
            "reached": reached}) + "\n")
        nginx_before = render.nginx_conf(new).read_text()
        try:
            render.render(new)
        except render.RenderError:  # nothing was replaced: no apply is under way, or the
            if earlier is None:     # earlier one's record stands as it was
                marker.unlink(missing_ok=True)
            else:
                marker.write_text(earlier)
            raise
        forget_overridden(old, new)
    with processes.supervisor(new) as proxy:
        steps = plan(old, new, proxy.shmserve.pending(["workers", "frontends"]), attempted)
    steps.nginx = nginx_differs(old, attempted, new, nginx_before)
    warn_gaps(old, new, steps)
    say("shmserve: steps:\n" + "\n".join(steps.lines()))
    run(new, old, steps, args.timeout if args.timeout is not None
        else new.workers.ready_timeout_s)
    topology.record_sources(new, args.env, args.config)  # as `up` keeps them
    marker.unlink()
    say("shmserve: applied")
    return 0


def run(new: Config, old: Config, steps: Plan, timeout: float) -> None:
    rest = f"; {stopped(new)}"
    program_config.mark_reached(new, steps.add_workers)
    for program in steps.add_workers:
        sync(new, "workers", program)  # supervisord starts it: it loads meanwhile
    before, after = steps.worker_phases()
    # The kept workers the order puts first (all of them, unless the frontends go first:
    # workers added beside kept ones that restart, or models removed; or only those that will
    # serve the new models where models are both added and removed: apply_plan.unit_order),
    # each ready in the frontends running then; workers added, loaded, before the frontends
    # restart where any kept one waits for them (the old frontends knew only the kept ones).
    workers(new, old, before, timeout)
    if after:
        for program in steps.add_workers:
            wait_loaded(new, program, timeout, rest)
    frontends(new, old, steps, timeout, rest)
    workers(new, new, after, timeout)
    sync(new, "nginx", "nginx", running=True)  # its stop timeout and logs: next start
    if steps.nginx and not steps.add_frontends:  # with frontends added: reloaded already
        reload_nginx(new)
    for program in steps.remove_frontends:
        remove(new, "frontends", program)
        for path_of in (topology.frontend_socket, topology.frontend_grpc_socket):
            path_of(new, index_of(program)).unlink(missing_ok=True)  # (gRPC's: its stop's)
    # Workers added: every frontend sees them ready (it was restarted to), before any removed
    # one stops.
    for program in steps.add_workers:
        wait_until_ready(new, "workers", program, pid_of(new, program), timeout, rest,
                         done="started")
    for program in steps.remove_workers:
        remove(new, "workers", program)
    if steps.reaper:
        ctl(new, "restart", "reaper")
        say("shmserve: reaper restarted")  # the plan lists it; nothing said it was done


def workers(new: Config, frontends_of: Config, programs: list[str], timeout: float) -> None:
    """Kept workers, one at a time, each ready in every frontend of `frontends_of` (the
    frontends running meanwhile)."""
    during = dataclasses.replace(new, frontends=frontends_of.frontends)
    for program in programs:
        replace(during, "workers", program, timeout)


def frontends(new: Config, old: Config, steps: Plan, timeout: float, rest: str) -> None:
    """Frontends added, each ready, then nginx reloaded to send them requests before any kept
    one restarts (one frontend growing to two got 502s: nginx knew only the one restarting),
    then the kept ones one at a time."""
    program_config.mark_reached(new, steps.add_frontends)
    for program in steps.add_frontends:
        sync(new, "frontends", program)
        wait_until_ready(new, "frontends", program, pid_of(new, program), timeout, rest,
                         done="started")
    if steps.add_frontends:
        reload_nginx(new)
    for program in steps.roll_frontends:
        replace(new, "frontends", program, timeout)


def wait_loaded(cfg: Config, program: str, timeout: float, rest: str) -> None:
    """Until worker `program` has loaded, as its shmserve_worker_ready gauge says (the frontends
    running may not know it yet: they route to the workers their config names)."""
    from shmserve import remote

    index = index_of(program)
    wanted = f'shmserve_worker_ready{{worker="{index}"}} 1.0'
    say(f"shmserve: {program}: waiting until it has loaded")
    deadline = time.monotonic() + timeout
    while True:
        for i in range(cfg.frontends.count):
            code, body = remote.get_unix(str(topology.frontend_socket(cfg, i)), "/metrics")
            if code == 200 and wanted in body.decode(errors="replace"):
                say(f"shmserve: {program} loaded")
                return
        if time.monotonic() > deadline:
            raise CliError(f"{program} did not load within {timeout:g} s{rest}; logs in "
                           f"{topology.log_dir(cfg)}")
        time.sleep(0.5)


def stopped(cfg: Config) -> str:
    """What an apply that stopped at a step says last: the file that keeps the config from
    before it named where it is (it said run/apply.json whatever server.run_dir was)."""
    return ("the apply stopped there: fix the cause, then `shmserve apply` again goes on "
            f"({topology.apply_marker_path(cfg)} keeps the config from before it)")


def sync(cfg: Config, group: str, program: str, running: bool = False) -> str:
    with processes.supervisor(cfg) as proxy:
        done = proxy.shmserve.syncProcess(group, program, running)
    if done in ("added", "removed", "replaced"):  # the program as supervisord runs it
        say(f"shmserve: {program}: {done} ({'started' if done == 'added' else 'stopped'})"
            if done != "replaced" else f"shmserve: {program}: its program replaced")
    return done


def replace(cfg: Config, group: str, program: str, timeout: float) -> None:
    """Stop `program` (it drains), make it as the rendered config says, start it and wait until
    it serves again. One stopped by a command (`shmserve ctl stop`) is made as the config says
    and left stopped: an apply started it again. One an apply or a restart killed between its
    stop and its start left stopped (shmserve.restart_record, which this stop and start are
    recorded in as a restart's are) is started, as that command would have."""
    if state_of(cfg, program) == "STOPPED":
        if program in restart_record.stopped_by_restart(cfg, process_info(cfg)):
            say(f"shmserve: {restart_record.said(cfg, [program])} on the new config")
        else:
            program_config.mark_reached(cfg, [program])
            sync(cfg, group, program)
            say(f"shmserve: {program} is stopped (a stop command): left stopped, on the new "
                f"config when it starts (`shmserve ctl start {group}:{program}`)")
            return
    restart_record.begin(cfg, [f"{group}:{program}"], "apply")
    ctl(cfg, "stop", f"{group}:{program}")
    sync(cfg, group, program)
    with processes.supervisor(cfg) as proxy:
        try:
            proxy.supervisor.startProcess(f"{group}:{program}", False)
        except xmlrpc.client.Fault as exc:
            if "ALREADY_STARTED" not in exc.faultString:  # supervisord's autostart came first
                raise CliError(f"supervisord could not start {program}: {exc.faultString}")
    restart_record.end(cfg)
    wait_until_ready(cfg, group, program, pid_of(cfg, program), timeout,
                     rest=f"; {stopped(cfg)}")


def remove(cfg: Config, group: str, program: str) -> None:
    ctl(cfg, "stop", f"{group}:{program}")
    sync(cfg, group, program)


def state_of(cfg: Config, program: str) -> str:
    """`program`'s state as supervisord says it (RUNNING, STOPPED, ...); "" where it has none."""
    return next((p["statename"] for p in process_info(cfg) if p["name"] == program), "")


def pid_of(cfg: Config, program: str, wait_s: float = 10.0) -> int:
    """`program`'s pid once supervisord has started it."""
    deadline = time.monotonic() + wait_s
    while True:
        pid = next((p["pid"] for p in process_info(cfg) if p["name"] == program), 0)
        if pid or time.monotonic() > deadline:
            return pid
        time.sleep(0.1)


def add_parser(command) -> None:
    cmd = command("apply", apply, "apply the config as the files and environment give it now "
                  "to the running deployment, one process at a time (counts, batching, limits, "
                  "nginx, models)")
    cmd.add_argument("--dry-run", action="store_true", help="print the changes and do nothing")
    cmd.add_argument("--move", action="store_true", help="apply a change of where clients "
                     "reach the deployment (server.host, server.port, TLS on or off); refused "
                     "without it")
    cmd.add_argument("--timeout", type=seconds, help="seconds to wait for each started program "
                     "to be ready (default: workers.ready_timeout_s)")


def changed(old: Config, new: Config, attempted: list[Config]) -> list[str]:
    """The keys an apply changes, as `itemized` shows them: from `old`, and, where an earlier
    apply stopped part way, from each config it was applying (programs it restarted run that):
    a config put back named no key, only "the config from before the earlier apply", where a
    dry run lists every changed key (an outside check)."""
    out = itemized(old, new)
    seen = set(out)
    for tried in attempted:
        for line in itemized(tried, new):
            if line not in seen:
                seen.add(line)
                out.append(f"{line} (the earlier apply's, on the programs it restarted)")
    return out


def itemized(old: Config, new: Config) -> list[str]:
    """configview.differences for reading: a list of named mappings (models) is shown model by
    model, each changed field (`models[m].source: "a" -> "b"`), and those added or removed by
    name, not as the whole list before and after (an outside check); secrets as there. Only
    `apply` prints it."""
    out = []
    before, after = (configview.flat(configview.redacted(c)) for c in (old, new))
    for line in configview.differences(old, new):
        key = line.partition(":")[0]
        a, b = before.get(key), after.get(key)
        if (key in configview.SECRET_KEYS or not isinstance(a, list) or not isinstance(b, list)
                or not all(isinstance(x, dict) and "name" in x for x in a + b)):
            out.append(line)
            continue
        was, now = {x["name"]: x for x in a}, {y["name"]: y for y in b}
        for name in [*was, *(n for n in now if n not in was)]:
            x, y = was.get(name), now.get(name)
            if x is None or y is None:
                out.append(f"{key}[{name}]: {'added' if x is None else 'removed'}")
                continue
            out += [f"{key}[{name}].{field}: {json.dumps(x.get(field))} -> "
                    f"{json.dumps(y.get(field))}"
                    for field in sorted(x.keys() | y.keys()) if x.get(field) != y.get(field)]
        if list(was) != list(now) and set(was) == set(now):
            out.append(f"{key}: the same, in another order")
    return out
