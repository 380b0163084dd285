"""A worker's models in slots, and their hot reload.

Each unit (shmserve.models) has one active slot. A reload loads the new weights into a standby
slot while the active one keeps serving, then switches between two batches; the old slot retires
and is freed once no queued text is pinned to it. Texts are pinned to their unit's active slot
when the model thread takes their request in, and the batcher groups texts by slot key, so no
batch and no request ever mixes revisions.

One reload at one worker:
    Reload        -> loading   a loader thread builds the slot: source within the model roots,
                               compatible with the active one, loaded, warmed up
    (built)       -> staged    answered ReloadDone(OK); waits for the frontend's commit
    Commit(keep)  -> active    the old slot retires
    Commit(drop), or staged for longer than admin.reload_timeout_s, or its frontend gone: the
                               staged slot is freed (a load under way is cancelled)
A failed load answers ReloadDone(INVALID | FAILED) and leaves the active slot as it was.

The run state (shmserve.state: the source each reloaded unit serves) is the truth a worker
converges to (`reconcile`): a unit serving another source than the state records switches to a
standby holding it, else loads it itself and switches once loaded. A worker that restarted while
a reload was under way had loaded the sources from before it, and one whose reload's frontend
died between recording the state and committing held the new weights staged: a model answered
from two revisions until someone restarted a worker (an outside check).

Threads: every method runs on the model thread, except `build`, which runs on the loader thread
and hands its outcome back through `post` (the worker's inbox): the table has one writer.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from shmserve import state, topology
from shmserve.config import Config, ModelConfig
from shmserve.models import ModelSourceError, ModelSpec, hosted, inspect
from shmserve.protocol import Commit, ModelInfo, Reload, ReloadDone, ReloadStatus

log = logging.getLogger("shmserve.worker")


@dataclass(eq=False)
class Slot:
    key: str  # unique in this worker; the batcher groups texts by it
    spec: ModelSpec
    source: str
    model: Any


@dataclass(eq=False)
class Job:
    ticket: str
    peer: bytes  # the frontend that asked; b"": the run state's (reconcile), switched when built
    seq: int
    revision: str
    cancelled: bool = False
    since: float = field(default_factory=time.monotonic)
    wanted: tuple[str, str] | None = None  # the run state's (source, revision), reconcile's


@dataclass(frozen=True, slots=True)
class Staged:
    """A standby slot, loaded and warmed, waiting for its reload's commit."""

    slot: Slot
    ticket: str
    since: float  # monotonic
    peer: bytes  # the frontend whose commit it waits for


@dataclass(eq=False)
class Unit:
    config: ModelConfig
    active: Slot
    loading: Job | None = None
    standby: Staged | None = None
    retiring: list[Slot] = field(default_factory=list)
    switched: str = ""  # the ticket of the last switch (a Commit of it that comes late: OK)
    unreachable: tuple[str, str] | None = None  # the run state's, which failed to load here


@dataclass(frozen=True, slots=True)
class Orphaned:
    """A frontend gone (gpu_workers.intake): its reloads are answered to no one."""

    peer: bytes


@dataclass(frozen=True, slots=True)
class Built:
    """A loader thread's outcome, posted to the model thread."""

    unit: str
    ticket: str
    slot: Slot | None
    error: BaseException | None


Reply = tuple[bytes, ReloadDone]
# (unit config with the new source and revision, the active spec) -> (new spec, loaded model)
Build = Callable[[ModelConfig, ModelSpec], tuple[ModelSpec, Any]]


class Slots:
    def __init__(self, build: Build, release: Callable[[], None],
                 post: Callable[[Built], None], stage_timeout_s: float,
                 reconciled: Callable[[str, str], None] = lambda unit, outcome: None) -> None:
        """`release` returns freed memory to the device once a slot dropped its model;
        `reconciled(unit, outcome)` counts what `reconcile` did: standby, loaded or failed."""
        self._build = build
        self._release = release
        self._reconciled = reconciled
        self._post = post
        self._stage_timeout = stage_timeout_s
        self._ids = itertools.count()
        self.units: dict[str, Unit] = {}

    def add(self, config: ModelConfig, spec: ModelSpec, model: Any) -> None:
        self.units[config.name] = Unit(config, self._slot(spec, config.source, model))

    def active(self, unit: str) -> Slot:
        return self.units[unit].active

    def infos(self) -> tuple[ModelInfo, ...]:
        out = []
        for unit in self.units.values():
            s = unit.active.spec
            state, standby = "ready", ""
            if unit.loading is not None and not unit.loading.cancelled:
                state, standby = "loading", unit.loading.revision
            elif unit.standby is not None:
                state, standby = "staged", unit.standby.slot.spec.revision
            elif unit.unreachable is not None:  # serving apart from the run state
                state = "diverged"
            out.append(ModelInfo(s.name, s.task, s.dim, s.max_tokens, s.dtype, s.revision,
                                 state, standby, getattr(unit.active.model, "loader", "")))
        return tuple(out)

    # ---- reload -------------------------------------------------------------------------

    def reload(self, peer: bytes, msg: Reload) -> list[Reply]:
        unit = self.units.get(msg.model)
        if unit is None:
            return [_reply(peer, msg.seq, ReloadStatus.INVALID, "",
                           f"model {msg.model!r} is not loaded on this worker")]
        if busy := _under_way(unit, self._stage_timeout):
            return [_reply(peer, msg.seq, ReloadStatus.BUSY, "",
                           f"another reload of {msg.model!r} is in progress on this worker "
                           f"({busy})")]
        source = msg.source or unit.active.source
        self._start(msg.model, unit, Job(msg.ticket, peer, msg.seq, msg.revision), source)
        log.info("worker.reload_started", extra={"fields": {
            "model": msg.model, "source": source, "revision": msg.revision, "ticket": msg.ticket}})
        return []

    def _start(self, name: str, unit: Unit, job: Job, source: str) -> None:
        """`job`'s load of `source` (its revision) on a loader thread of its own."""
        unit.loading = job
        config = dataclasses.replace(unit.config, source=source, revision=job.revision)
        threading.Thread(target=self._load, args=(name, job.ticket, config, unit.active.spec),
                         name=f"load-{name}", daemon=True).start()

    def _load(self, name: str, ticket: str, config: ModelConfig, active: ModelSpec) -> None:
        """The loader thread: build, then hand the outcome to the model thread."""
        try:
            spec, model = self._build(config, active)
            self._post(Built(name, ticket, self._slot(spec, config.source, model), None))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller of the reload
            self._post(Built(name, ticket, None, exc))

    def built(self, item: Built) -> list[Reply]:
        unit = self.units[item.unit]
        job = unit.loading
        if job is None or job.ticket != item.ticket:  # cancelled, and replaced by a newer one
            self._free(item.slot)
            return []
        unit.loading = None
        if job.cancelled:
            self._free(item.slot)
            return []
        if not job.peer:  # the run state's: nobody to commit it
            if item.error is not None:
                unit.unreachable = job.wanted
                self._reconciled(item.unit, "failed")
                log.error("worker.reconcile_failed", extra={"fields": {
                    "model": item.unit, "source": job.wanted[0], "revision": job.revision,
                    "serving": unit.active.spec.revision,
                    "error": f"{type(item.error).__name__}: {item.error}"}})
            else:
                self._switch(item.unit, unit, item.slot, job.ticket, "run_state")
                self._reconciled(item.unit, "loaded")
            return []
        if item.error is not None:
            status = (ReloadStatus.INVALID if isinstance(item.error, ModelSourceError)
                      else ReloadStatus.FAILED)
            message = f"{type(item.error).__name__}: {item.error}"
            log.warning("worker.reload_failed", extra={"fields": {
                "model": item.unit, "ticket": job.ticket, "error": message}})
            return [_reply(job.peer, job.seq, status, "", message)]
        unit.standby = Staged(item.slot, job.ticket, time.monotonic(), job.peer)
        log.info("worker.reload_staged", extra={"fields": {
            "model": item.unit, "revision": item.slot.spec.revision, "ticket": job.ticket,
            "dtype": item.slot.spec.dtype, "loader": getattr(item.slot.model, "loader", "")}})
        return [_reply(job.peer, job.seq, ReloadStatus.OK, item.slot.spec.revision, "staged")]

    def commit(self, peer: bytes, msg: Commit) -> list[Reply]:
        unit = self.units.get(msg.model)
        if unit is not None and unit.standby is not None and unit.standby.ticket == msg.ticket:
            slot, unit.standby = unit.standby.slot, None
            if not msg.keep:
                log.info("worker.reload_dropped", extra={"fields": {
                    "model": msg.model, "revision": slot.spec.revision, "ticket": msg.ticket}})
                self._free(slot)
                return [_reply(peer, msg.seq, ReloadStatus.OK, unit.active.spec.revision,
                               "dropped")]
            self._switch(msg.model, unit, slot, msg.ticket, "commit")
            return [_reply(peer, msg.seq, ReloadStatus.OK, slot.spec.revision, "switched")]
        if unit is not None and msg.ticket == unit.switched and msg.keep:
            # switched here already, the run state recording it (reconcile)
            return [_reply(peer, msg.seq, ReloadStatus.OK, unit.active.spec.revision,
                           "switched")]
        if unit is not None and unit.loading is not None and unit.loading.ticket == msg.ticket \
                and not msg.keep:
            unit.loading.cancelled = True  # its slot is freed when the loader thread is done
            log.info("worker.reload_cancelled", extra={"fields": {
                "model": msg.model, "ticket": msg.ticket}})
            return [_reply(peer, msg.seq, ReloadStatus.OK, unit.active.spec.revision,
                           "cancelled")]
        return [_reply(peer, msg.seq, ReloadStatus.INVALID, "",
                       f"no staged reload {msg.ticket} of {msg.model!r} here (it expired, or "
                       "was never staged)")]

    def _switch(self, name: str, unit: Unit, slot: Slot, ticket: str, by: str) -> None:
        unit.retiring.append(unit.active)
        unit.active = slot
        unit.switched = ticket
        unit.unreachable = None  # whatever it serves now, the next reconcile compares
        log.info("worker.switched", extra={"fields": {
            "model": name, "revision": slot.spec.revision, "ticket": ticket, "by": by}})

    def expire(self, now: float) -> list[Reply]:
        """Free standby slots staged and never committed (their frontend went away)."""
        for name, unit in self.units.items():
            if unit.standby is not None and now - unit.standby.since > self._stage_timeout:
                log.warning("worker.reload_expired", extra={"fields": {
                    "model": name, "ticket": unit.standby.ticket}})
                slot, unit.standby = unit.standby.slot, None
                self._free(slot)
        return []

    def orphaned(self, peer: bytes) -> list[Reply]:
        """Cancel the reloads frontend `peer` asked for: it is gone, and its commit will never
        come (they held a standby, and refused other reloads 409, for admin.reload_timeout_s:
        an outside check). Reconcile first: a standby the run state records switches."""
        for name, unit in self.units.items():
            if unit.loading is not None and unit.loading.peer == peer and \
                    not unit.loading.cancelled:
                unit.loading.cancelled = True  # its slot is freed when the loader is done
                log.info("worker.reload_cancelled", extra={"fields": {
                    "model": name, "ticket": unit.loading.ticket, "reason": "frontend_gone"}})
            if unit.standby is not None and unit.standby.peer == peer:
                log.info("worker.reload_dropped", extra={"fields": {
                    "model": name, "ticket": unit.standby.ticket, "reason": "frontend_gone"}})
                slot, unit.standby = unit.standby.slot, None
                self._free(slot)
        return []

    def reconcile(self, sources: Mapping[str, Mapping[str, str]]) -> list[Reply]:
        """Each unit to the source the run state records for it (the module's docstring).
        A reload under way is left to its commit or drop; a recorded source that failed to
        load here is not tried again until the state records another."""
        for name, unit in self.units.items():
            wanted = sources.get(name)
            if not wanted or _holds(unit.active, wanted):
                unit.unreachable = None
                continue
            if unit.standby is not None and _holds(unit.standby.slot, wanted):
                slot, ticket, unit.standby = unit.standby.slot, unit.standby.ticket, None
                self._switch(name, unit, slot, ticket, "run_state")
                self._reconciled(name, "standby")
                continue
            key = (wanted["source"], wanted.get("revision", ""))
            if _under_way(unit, self._stage_timeout) or unit.unreachable == key:
                continue
            ticket = f"state-{uuid.uuid4().hex}"
            self._start(name, unit, Job(ticket, b"", 0, key[1], wanted=key), key[0])
            log.warning("worker.reconciling", extra={"fields": {
                "model": name, "source": key[0], "revision": key[1], "ticket": ticket,
                "serving": unit.active.spec.revision, "serving_source": unit.active.source}})
        return []

    def collect(self, pinned: set[str]) -> None:
        """Free retired slots that no queued text is pinned to (`pinned`: their slot keys)."""
        for unit in self.units.values():
            for slot in [s for s in unit.retiring if s.key not in pinned]:
                unit.retiring.remove(slot)
                log.info("worker.slot_freed", extra={"fields": {
                    "model": slot.spec.name, "revision": slot.spec.revision}})
                self._free(slot)

    def _slot(self, spec: ModelSpec, source: str, model: Any) -> Slot:
        return Slot(f"{spec.name}#{next(self._ids)}", spec, source, model)

    def _free(self, slot: Slot | None) -> None:
        if slot is not None:
            slot.model = None  # the last reference: queued requests hold slots, never models
            self._release()


def hosted_configs(cfg: Config, index: int, reloaded: bool = True) -> dict[str, ModelConfig]:
    """The units worker `index` hosts, with the sources a reload left in the run state (so a
    restarted worker serves what the others serve); a recorded source that is gone is logged and
    the configured one loaded instead. `reloaded` False: as the config gives them."""
    overrides = state.read(cfg).sources if reloaded else {}
    configs = {}
    for unit in hosted(cfg, topology.worker_devices(cfg), index):
        config, over = unit.config, overrides.get(unit.name)
        if over is not None:
            changed = dataclasses.replace(config, source=over["source"],
                                          revision=over["revision"])
            try:
                inspect(changed, with_revision=False, roots=cfg.model_root_paths)
                config = changed
            except ModelSourceError as exc:
                log.error("worker.reloaded_source_gone", extra={"fields": {
                    "model": unit.name, "source": over["source"], "error": str(exc)}})
        configs[unit.name] = config
    return configs


def _holds(slot: Slot, wanted: Mapping[str, str]) -> bool:
    """Whether `slot` holds what the run state records: its source, and its revision where
    one was given (none: the weights' digest, whatever it is)."""
    return slot.source == wanted["source"] and (
        not wanted.get("revision") or slot.spec.revision == wanted["revision"])


def _under_way(unit: Unit, stage_timeout: float) -> str:
    """What reload of `unit` is under way here, in words; "" if none."""
    now = time.monotonic()
    if unit.loading is not None and not unit.loading.cancelled:
        job = unit.loading
        whose = "the run state's" if not job.peer else "an admin call's"
        return (f"{whose}, loading revision {job.revision or '(its digest)'} for "
                f"{now - job.since:.0f} s")
    if unit.standby is not None:
        return (f"revision {unit.standby.slot.spec.revision} staged {now - unit.standby.since:.0f}"
                f" s ago, waiting for its commit; dropped at {stage_timeout:g} s "
                "(admin.reload_timeout_s) if none comes")
    return ""


def _reply(peer: bytes, seq: int, status: ReloadStatus, revision: str,
           message: str) -> Reply:
    return peer, ReloadDone(seq, status, revision, message)
