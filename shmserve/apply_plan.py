"""What `shmserve apply` does for a change of config (shmserve.apply runs it): which programs
start, restart and stop, in which order, decided from the keys that changed, the counts, and
what supervisord runs otherwise than the rendered file says (shmserve.supervisor_rpc's
`pending`). No process is touched here.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Callable

from shmserve import configview, models, render, state, tls, topology
from shmserve.config import Config
from shmserve.prechecks import CliError
from shmserve.restarts import say

# Keys no worker process reads (gpu_workers/, and the shmserve modules it runs): a change of
# only these leaves the workers running. tests/unit/test_apply.py reads the workers' code for
# each of them. frontends.count: a worker learns the frontends from their pings.
FRONTEND_SIDE = ("nginx.", "limits.", "auth.", "tracing.", "shm.", "server.host",
                 "server.port", "server.grpc_port", "admin.token", "frontends.")
READ_BY_WORKERS = ("frontends.hung_kill_s", "frontends.spread_part_texts")
# Keys no frontend reads (frontend/ and the shmserve modules it runs): a change of only these
# leaves the frontends running (the worker count changing restarts them anyway).
WORKER_SIDE = ("batching.", "logging.batch_log", "workers.torch_threads",
               "workers.cuda_alloc_conf", "workers.cudnn_attention", "workers.cpu_fallback",
               "workers.cuda_graphs", "workers.switch_interval_ms", "workers.reload_nice",
               "workers.memory_check_batches", "workers.empty_cache_free_below",
               "workers.empty_cache_idle_s", "workers.queue_texts",
               "workers.low_priority_queue_share")
READ_BY_FRONTENDS = ("batching.max_batch_size", "batching.max_batch_tokens")
# nginx's keys a frontend mirrors (its body and header limits, the deadline cap, the admin
# routes' loopback rule); the others (rate limits, gzip, CORS, timeouts, ...) only nginx reads:
# a reload, no restart.
NGINX_READ_BY_FRONTENDS = ("nginx.client_max_body_size", "nginx.large_client_header_buffers",
                           "nginx.proxy_read_timeout_s", "nginx.admin_loopback_only")
# How many workers there are, and on which devices: a worker kept restarts only when its own
# device or the models it loads changed (and for any other key it reads).
COUNT_KEYS = ("workers.cpu_workers", "workers.devices", "workers.per_gpu")
# Set when supervisord starts, which apply cannot change under it.
FIXED = ("logging.stdout",)


@dataclass
class Plan:
    add_workers: list[str] = field(default_factory=list)
    roll_workers: list[str] = field(default_factory=list)
    add_frontends: list[str] = field(default_factory=list)
    roll_frontends: list[str] = field(default_factory=list)
    nginx: bool = False
    remove_frontends: list[str] = field(default_factory=list)
    remove_workers: list[str] = field(default_factory=list)
    frontends_first: bool = False  # the frontends restart before the kept workers
    # Models both added and removed (one renamed, the default replaced): these of roll_workers
    # restart before the frontends, the others after (unit_order)
    workers_before_frontends: list[str] = field(default_factory=list)
    # ... and where no order serves both sides: the old models that go unserved meanwhile
    unserved: list[str] = field(default_factory=list)
    reaper: bool = False  # restarted at the end: it names every program, and logs
    reshaped: list[str] = field(default_factory=list)  # models whose units change names

    def worker_phases(self) -> tuple[list[str], list[str]]:
        """The kept workers restarted before the frontends, and those after them."""
        before = (self.workers_before_frontends if self.workers_before_frontends
                  else [] if self.frontends_first else self.roll_workers)
        return before, [w for w in self.roll_workers if w not in before]

    def lines(self) -> list[str]:
        workers = [("start", self.add_workers), ("restart one at a time", self.roll_workers)]
        frontends = [("start", self.add_frontends),
                     ("reload its configuration", ["nginx"] if self.nginx else []),
                     ("restart one at a time", self.roll_frontends)]
        if not self.add_frontends:  # nginx reloads once the frontends are as they will be
            frontends = [frontends[0], frontends[2], frontends[1]]
        before, after = self.worker_phases()
        steps = [workers[0], ("restart one at a time", before), *frontends,
                 ("restart one at a time", after)]
        steps += [("stop", self.remove_frontends), ("stop", self.remove_workers),
                  ("restart", ["reaper"] if self.reaper else [])]
        return ([f"  {what}: {', '.join(names)}" for what, names in steps if names]
                or ["  no process restarts"])


def warn_gaps(old: Config, new: Config, steps: Plan) -> None:
    """What the restarts leave unserved meanwhile (a single frontend, a model on one worker),
    as `restart` says it. While they restart, the programs to be stopped still serve and those
    added already do."""
    from shmserve.restarts import gap_of, restart_gap  # (it imports this module's say)

    if steps.reshaped:
        many = len(steps.reshaped) > 1
        say(f"shmserve: warning: what the workers load under {', '.join(steps.reshaped)} "
            f"changes (a model to A/B variants, or back): requests for {'them' if many else 'it'}"
            " fail from the first "
            "worker's restart until every frontend has restarted; to change without a gap, "
            "serve the new form under a new name, or use `shmserve split`", sys.stderr)
    if steps.unserved:
        default = (" and those naming no model" if old.models[0].name != new.models[0].name
                   else "")
        say(f"shmserve: warning: no order of restarts serves both configs' models throughout "
            f"(one worker, or each old model on a worker a new one needs): requests for "
            f"{', '.join(steps.unserved)}{default} fail from the restart of the last worker "
            "serving them until every frontend has restarted", sys.stderr)
    most = max(old, new, key=lambda c: len(topology.worker_devices(c)))
    for group, rolled, count in (
            ("workers", steps.roll_workers, len(topology.worker_devices(most))),
            ("frontends", steps.roll_frontends, max(old.frontends.count, new.frontends.count))):
        if not rolled:
            continue
        programs = [f"{group[:-1]}-{i}" for i in range(count)]
        lone = lone_during(old, new, steps) if group == "workers" else {}
        if warning := restart_gap(group, "*", programs, False, lone):
            say(f"shmserve: warning: {warning}", sys.stderr)
    # Down to one: this apply is served throughout, the next restart of it is not (the README's
    # condition for restarts without a gap, which apply did not say: an outside check)
    for group, before, after in (
            ("frontends", old.frontends.count, new.frontends.count),
            ("workers", len(topology.worker_devices(old)), len(topology.worker_devices(new)))):
        if after == 1 < before:
            say(f"shmserve: warning: one program in {group} from now on: while it restarts (a "
                f"`restart`, or an apply that restarts it), {gap_of(group)}", sys.stderr)


def touches(key: str, side: tuple[str, ...], read_anyway: tuple[str, ...]) -> bool:
    """Whether a change of `key` reaches the processes whose keys are not in `side`."""
    return not key.startswith(side) or key in read_anyway


def plan(old: Config, new: Config, pending: dict[str, list[str]],
         attempted: list[Config] = ()) -> Plan:
    """What applying `new` over `old` does; `pending`: supervisor_rpc's `pending` for the two
    groups after the run directory was rendered for `new`; `attempted`: the configs earlier
    applies stopped part way to (the processes they restarted run them, so what differs from
    them restarts too, even when `new` is `old` again)."""
    lines = configview.differences(old, new)
    for earlier in attempted:
        lines += configview.differences(earlier, new)
    keys = sorted({line.partition(":")[0] for line in lines})
    out = Plan()
    names = {kind: [p.partition(":")[2] for p in pending[kind]] for kind in pending}

    def of(prefix: str, kind: str) -> list[str]:
        return sorted((n for n in names[kind] if n.startswith(prefix)), key=index_of)

    n_workers = len(topology.worker_devices(new))
    kept_workers = [f"worker-{i}" for i in range(min(n_workers, len(topology.worker_devices(old))))]
    kept_frontends = [f"frontend-{i}" for i in range(min(new.frontends.count,
                                                         old.frontends.count))]
    out.add_workers, out.remove_workers = of("worker-", "added"), of("worker-", "removed")
    out.add_frontends, out.remove_frontends = of("frontend-", "added"), of("frontend-", "removed")
    workers_changed = any(touches(k, FRONTEND_SIDE, READ_BY_WORKERS) for k in keys
                          if k not in COUNT_KEYS)
    # A worker an earlier apply moved (another device) runs that config still: the dry run
    # knows it from the attempts, as the run knows it from supervisord (the dry run left
    # out worker-0 when undoing an apply that stopped after moving it: an outside check)
    out.roll_workers = [w for i, w in enumerate(kept_workers)
                        if workers_changed or w in names["changed"] or any(
                            moved(was, new, i) for was in (old, *attempted)
                            if i < len(topology.worker_devices(was)))]
    frontends_changed = (any(frontend_reads(k) for k in keys)
                         or out.add_workers or out.remove_workers)
    out.roll_frontends = [f for f in kept_frontends
                          if frontends_changed or f in names["changed"]]
    before, after = unit_names(old), unit_names(new)
    added, removed = after - before, before - after
    out.reshaped = sorted({u.partition("@")[0] for u in added}
                          & {u.partition("@")[0] for u in removed})
    # Models only removed: the frontends stop routing to them before the workers drop them.
    # Workers added beside kept ones that restart: the frontends learn the new ones first.
    # Models added: the workers first, so the frontends find them served.
    out.frontends_first = not added and bool(
        removed or (out.add_workers and out.roll_workers))
    if added and removed:
        # Neither order serves both sides' models throughout (the old frontends' default
        # model went unserved from the last of its workers' restarts: an outside check)
        first = unit_order(old, new, out.roll_workers)
        if first is not None:
            out.reshaped = []  # served throughout, by the frontends of either side
            out.workers_before_frontends, out.frontends_first = first, not first
        elif not out.reshaped:  # (a reshaped model's warning says it, with what to do)
            out.unserved = sorted(removed)
    # the TLS files too: it reads their dates (shmserve_tls_expiry_timestamp_seconds)
    out.reaper = bool(out.add_workers or out.remove_workers or out.add_frontends
                      or out.remove_frontends or any(k.startswith("logging.") for k in keys)
                      or any(k in tls.FILE_KEYS for k in keys))
    return out


def _serving(old: Config, new: Config, moved_on: set[int]) -> Callable[[int], set[str]]:
    """What worker i serves part way through an apply: `new`'s models once it restarted (in
    `moved_on`) or where it was added (apply waits until those have loaded), `old`'s else."""
    old_devices, new_devices = topology.worker_devices(old), topology.worker_devices(new)

    def hosts(i: int) -> set[str]:
        moved = i in moved_on or i >= len(old_devices)
        return {u.name for u in (models.hosted(new, new_devices, i) if moved
                                 else models.hosted(old, old_devices, i))}
    return hosts


def unit_order(old: Config, new: Config, rolled: list[str]) -> list[str] | None:
    """Those of the `rolled` workers to restart before the frontends, so that while the
    frontends restart, every model of `new` has a restarted (or added) worker that serves it
    and every model of `old` still has one that serves it (each side's frontends route to the
    workers of its own count); None where no choice does (one worker), [] where none is
    needed."""
    old_count, new_count = len(topology.worker_devices(old)), len(topology.worker_devices(new))

    def serving(first: set[int], count: int) -> set[str]:
        return set().union(*map(_serving(old, new, first), range(count)))

    old_units, new_units = unit_names(old), unit_names(new)
    first: list[int] = []
    candidates = [index_of(w) for w in rolled]
    while not new_units <= serving(set(first), new_count):
        missing = new_units - serving(set(first), new_count)
        for i in candidates:
            if i not in first and missing & _serving(old, new, {i})(i) \
                    and old_units <= serving({*first, i}, old_count):
                first.append(i)
                break
        else:
            return None
    return [f"worker-{i}" for i in first]


def lone_during(old: Config, new: Config, steps: Plan) -> dict[str, list[str]]:
    """Per worker this apply restarts, the models (A/B arms as MODEL@VARIANT) that the
    frontends running then route to and no other worker serves while it restarts, in the
    order `steps` restarts them: what each restart leaves unserved. Read from either config
    alone, the warning named models no frontend still routed to, and missed those whose other
    hosts had already moved (an outside check)."""
    restarted: set[int] = set()
    hosts = _serving(old, new, restarted)  # (reads `restarted` as it grows)
    before, after = steps.worker_phases()
    order = [(w, old) for w in before] + [(w, new) for w in after]
    lone: dict[str, list[str]] = {}
    for program, routing in order:
        i, count = index_of(program), len(topology.worker_devices(routing))
        others = set().union(*(hosts(j) for j in range(count) if j != i))
        if only := sorted(hosts(i) & unit_names(routing) - others - set(steps.unserved)):
            lone[program] = only
        restarted.add(i)
    return lone


def by_counts(old: Config, new: Config, running: list[str] | None = None
              ) -> dict[str, list[str]]:
    """`pending` as the counts tell it, before anything is rendered (--dry-run): `new`'s
    programs against `running` (GROUP:NAME, as supervisord runs them), else `old`'s. After an
    apply that stopped part way they differ: its dry run listed the counts' steps, not what the
    apply then did (an outside check)."""
    out: dict[str, list[str]] = {"added": [], "removed": [], "changed": []}
    for group, before, after in (
            ("workers", len(topology.worker_devices(old)), len(topology.worker_devices(new))),
            ("frontends", old.frontends.count, new.frontends.count)):
        name = group[:-1]
        wanted = {f"{group}:{name}-{i}" for i in range(after)}
        have = ({p for p in running if p.startswith(f"{group}:")} if running is not None
                else {f"{group}:{name}-{i}" for i in range(before)})
        out["added"] += sorted(wanted - have, key=index_of)
        out["removed"] += sorted(have - wanted, key=index_of)
    return out


# Keys only nginx reads outside its own section: where it listens (a change restarted the
# frontends, which listen on their unix sockets whatever the port; an outside check)
NGINX_ONLY = ("server.host", "server.port")


def frontend_reads(key: str) -> bool:
    """Whether a frontend reads `key` (nginx's keys: only those whose limits it mirrors)."""
    if key.startswith("nginx."):
        return key in NGINX_READ_BY_FRONTENDS
    if key in NGINX_ONLY:
        return False
    return touches(key, WORKER_SIDE, READ_BY_FRONTENDS)


def unit_names(cfg: Config) -> set[str]:
    """What the workers load, by name: models, and MODEL@VARIANT for A/B ones."""
    return {u.name for m in cfg.models for u in models.units(m)}


def moved(old: Config, new: Config, index: int) -> bool:
    """Whether worker `index` runs on another device, or loads other models, under `new`."""
    before, after = topology.worker_devices(old), topology.worker_devices(new)
    return before[index] != after[index] or (
        sorted(u.name for u in models.hosted(old, before, index))
        != sorted(u.name for u in models.hosted(new, after, index)))


def index_of(name: str) -> int:
    return int(name.rpartition("-")[2])


def nginx_differs(old: Config, attempted: list[Config], new: Config, on_disk: str) -> bool:
    """Whether nginx must reload for `new`: its file as rendered now (`on_disk`, before this
    apply rendered) differs, or, resumed, nginx may run what the apply before or an attempt
    rendered. A resumed apply reloaded nginx always, and a reload costs requests on idle
    keep-alive connections (README: restart nginx), for a change of the workers' alone (an
    outside check)."""
    wanted = render.render_nginx(new)
    return wanted != on_disk or any(render.render_nginx(was) != wanted
                                    for was in ((old, *attempted) if attempted else ()))


def changed_models(old: Config, new: Config) -> list[str]:
    """The models added, removed, or whose config differs in any key."""
    before, after = {m.name: m for m in old.models}, {m.name: m for m in new.models}
    return sorted(m for m in before.keys() | after.keys() if before.get(m) != after.get(m))


@contextlib.contextmanager
def reloads_held(old: Config, new: Config):
    """The reload locks of the models whose config changes, while apply records and renders
    the new config and drops their reloaded weights: a reload under way when apply dropped
    them wrote its source back after, and the restarted workers served it, not the config
    apply said served (an outside check). One under way now: refused, nothing changed."""
    with contextlib.ExitStack() as stack:
        for name in changed_models(old, new):
            try:
                stack.enter_context(state.reloading(new, name))
            except state.Busy:
                raise CliError(f"a reload of {name} is under way (an admin call), and this "
                               "apply changes its config; nothing was changed: apply again "
                               "once the reload has answered") from None
        yield


def forget_overridden(old: Config, new: Config, dry_run: bool = False) -> list[str]:
    """Drop what the admin API changed (run/state.json: a reloaded source, A/B weights) for
    the models whose config changed, so the restarted workers and frontends serve the config;
    what it changed for the others stays, as across restarts. The units and models dropped.
    `dry_run`: only say what would be (a dry run said nothing of it: an outside check)."""
    def by_unit(cfg: Config) -> dict[str, tuple]:
        return {u.name: (u.config.source, u.config.revision) for m in cfg.models
                for u in models.units(m)}

    before, after = by_unit(old), by_unit(new)
    splits = changed_models(old, new)
    # Every unit of a model whose config changed (any key: its dtype, its input limit), as
    # the README says; a reloaded source was kept unless its own source or revision changed,
    # while the message said it was dropped (an outside check)
    units = sorted(u for u in before.keys() | after.keys() if before.get(u) != after.get(u)
                   or u.partition("@")[0] in splits)
    current = state.read(new)
    reloads = [u for u in units if u in current.sources]
    weights = [m for m in splits if m in current.splits]
    if reloads or weights:
        def change(tree: dict) -> None:
            for unit in units:
                tree["sources"].pop(unit, None)
            for model in splits:
                tree["splits"].pop(model, None)
        if not dry_run:
            state.update(new, change)
        said = ([f"the reloaded weights of {', '.join(reloads)}"] if reloads else []) + (
            [f"the split weights of {', '.join(weights)}"] if weights else [])
        # (a reload switches every worker at once; a restart one worker at a time)
        meanwhile = (" once every worker has restarted; until then the workers not yet "
                     "restarted answer with the reloaded weights, the others with the config's"
                     if reloads else "")
        say(f"shmserve: their models' config changed, so {' and '.join(said)} "
            f"{'would be' if dry_run else 'are'} dropped: the config serves{meanwhile}")
    return sorted({*reloads, *weights})
