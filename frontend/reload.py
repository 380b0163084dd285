"""A hot reload, driven by the frontend that received the admin call, over its DEALER sockets to
every worker that hosts the model (or the A/B variant):

  1. Reload(ticket, revision): each worker loads and warms the new weights into a standby slot
     while its active slot keeps serving, and answers once staged, or why it could not. The
     revision is the given one, else the weights' digest, taken here as a worker takes it.
  2. If every worker staged: the run state records the new source (so a worker that restarts
     loads it too), then Commit(keep): each switches between two batches and answers. Else
     Commit(drop) to those that staged: nothing changed anywhere, and the call says why.

A worker that misses its commit (it restarted during the reload, or this frontend died between
the two steps) converges on the run state by itself (gpu_workers.slots: reconcile), and one
whose reload's frontend is gone drops its standby.

So a model switches on every worker or on none. Each phase waits at most
admin.reload_timeout_s; a worker that does not answer in time counts as failed. Every frontend
learns the new revision from the replies it gets (Result.revision) and from heartbeats.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from aiohttp import web

from frontend import metrics, variants
from frontend.app import CONFIG, POOL
from frontend.errors import ApiError
from frontend.links import WorkerGone, WorkerLink, consume, did_not_load, failure
from frontend.variants import Variant
from shmserve import state, topology
from shmserve.models import (ModelSourceError, hosted, replacement, resolve_source, units,
                             weights_revision)
from shmserve.protocol import Commit, Reload, ReloadDone, ReloadStatus

# The call's error is the first of these kinds among the workers' answers: a bad source first
# (the caller can fix it), then a reload already in progress, then the workers' own failures.
_KINDS = ("invalid_request", "conflict", "internal_error", "unavailable")
_KIND_OF = {ReloadStatus.INVALID: "invalid_request", ReloadStatus.BUSY: "conflict",
            ReloadStatus.FAILED: "internal_error"}


async def reload(app: web.Application, served, variant: Variant, source: str,
                 revision: str) -> dict:
    """Reload `variant` of the served model `served` everywhere; the answer body, or an
    ApiError. Counted by outcome, and a success timed (metrics.RELOADS, RELOAD_SECONDS:
    reloads showed only as admin requests, an outside check)."""
    started = time.monotonic()
    try:
        answer = await _reload_hosts(app, served, variant, source, revision)
    except ApiError as exc:
        metrics.RELOADS.labels(variant.unit, exc.kind).inc()
        raise
    metrics.RELOADS.labels(variant.unit, "ok").inc()
    metrics.RELOAD_SECONDS.labels(variant.unit).observe(time.monotonic() - started)
    return answer


async def _reload_hosts(app: web.Application, served, variant: Variant, source: str,
                        revision: str) -> dict:
    cfg, pool = app[CONFIG], app[POOL]
    model = served.spec.name
    devices = topology.worker_devices(cfg)
    hosts = [link for link in pool.links
             if any(u.name == variant.unit for u in hosted(cfg, devices, link.index))]
    # Workers that did not load it (they serve their other models and try it again) have no
    # revision to switch from: they take the new source at their next try, from the run state.
    failed = [link for link in hosts if failure(link, variant.unit)]
    serving = [link for link in hosts if link not in failed]
    down = [link.index for link in serving if not link.ready]
    if down:
        raise ApiError("unavailable", f"workers {down} host {variant.unit} and are not ready; "
                       "reload once GET /ready answers 200", retry_after=1)
    # A split's arms reload one at a time, the check of the others' revisions made under the
    # lock: two arms reloaded at once both took the same weights' digest (an outside check).
    locked = model if variant.name else variant.unit
    try:
        with state.reloading(cfg, locked):
            digest = await refuse_a_taken_revision(served, variant, source, revision, pool, cfg)
            if failed:
                await asyncio.get_running_loop().run_in_executor(
                    None, refuse_an_unservable, cfg, variant, source)
            if not serving:
                return await _load_where_failed(app, failed, model, variant, source, revision,
                                                digest)
            answer = await _reload(app, serving, model, variant, source, revision, digest)
    except state.Busy:
        raise ApiError("conflict", f"a reload of {locked} is already in progress (another "
                       "admin call); the served revision is unchanged by this one") from None
    why, retry_in = did_not_load(failed, variant.unit)
    answer["workers"] = sorted(answer["workers"] + [
        {"worker": link.index, "ok": True, "revision": None,
         "message": f"did not load {variant.unit} ({why}): it loads the source the run state "
                    "now records at once (GET /ready says when it serves it), else tries again "
                    f"in {retry_in:g} s"}
        for link in failed], key=lambda w: w["worker"])
    return answer


async def _load_where_failed(app: web.Application, failed: list[WorkerLink], model: str,
                             variant: Variant, source: str, revision: str,
                             digest: str | None) -> dict:
    """Every worker hosting `variant` failed to load it, so none can stage the new weights and
    check them: the run state records the source, which they load at once (Retries), and the
    call waits (admin.reload_timeout_s) until each serves it or fails it. A source one of them
    could not load is taken out of the run state again (422, its error), as a staged reload's
    would be dropped (it was recorded unchecked, an outside check)."""
    cfg, unit = app[CONFIG], variant.unit
    new = source or current_source(cfg, unit)
    label = revision or digest or await asyncio.get_running_loop().run_in_executor(
        None, weights_label, new, cfg.model_root_paths) or ""
    before = state.read(cfg).sources.get(unit)
    state.update(cfg, lambda tree: tree["sources"].__setitem__(unit, {
        "source": new, "revision": revision}))
    deadline = time.monotonic() + cfg.admin.reload_timeout_s
    while True:
        outcomes = {link.index: _outcome(link, unit, new, label) for link in failed}
        if all(outcomes.values()) or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.1)
    bad = {i: o for i, o in outcomes.items() if o not in ("ok", "")}
    if bad:
        def restore(tree: dict) -> None:
            if before is None:
                tree["sources"].pop(unit, None)
            else:
                tree["sources"][unit] = before
        state.update(cfg, restore)
        raise ApiError("invalid_request", f"reload of {unit} failed, nothing changed: "
                       + "; ".join(f"worker {i}: {o}" for i, o in sorted(bad.items())),
                       param="source")
    return {"model": model, **({"variant": variant.name} if variant.name else {}),
            "revision": label or None,
            "workers": [{"worker": i, "ok": o == "ok", "revision": label or None,
                         "message": "loaded" if o == "ok" else
                         f"still loading after {cfg.admin.reload_timeout_s:g} s "
                         "(admin.reload_timeout_s); the run state records it, which this worker "
                         "serves once loaded (GET /ready says when)"}
                        for i, o in sorted(outcomes.items())]}


def _outcome(link: WorkerLink, unit: str, source: str, label: str) -> str:
    """What worker `link` made of `unit`'s new source, by its heartbeats: "ok" once it serves
    it (at `label`, where known), its error once a try of `source` failed, "" until either."""
    beat = link.beat
    if beat is None or not link.alive:
        return ""
    if link.ready and any(i.name == unit and (not label or i.revision == label)
                          for i in beat.models):
        return "ok"
    return next((u.error for u in beat.unloaded if u.model == unit and u.source == source
                 and u.retry_in_s > 0), "")


def refuse_an_unservable(cfg, variant: Variant, source: str) -> None:
    """For workers that take a reload's source at their next load (they did not load the
    model): a source they could not serve, or one that cannot replace what the frontends serve,
    refused here (422), as a worker's Reload would."""
    config = next(u.config for m in cfg.models for u in units(m) if u.name == variant.unit)
    try:
        replacement(dataclasses.replace(config, source=source or config.source), variant.spec,
                    cfg.model_root_paths, with_revision=False)
    except ModelSourceError as exc:
        raise ApiError("invalid_request", str(exc), param="source") from None


def current_source(cfg, unit: str) -> str:
    """The source a unit serves: the last reload's (the run state), else the configured one."""
    return state.read(cfg).sources.get(unit, {}).get("source") or next(
        u.config.source for m in cfg.models for u in units(m) if u.name == unit)


async def refuse_a_taken_revision(served, variant: Variant, source: str, revision: str, pool,
                                  cfg) -> str | None:
    """422 when the reload would give `variant` the revision another arm of the split serves:
    the revision is what tells the arms apart (metrics, X-Model-Revision, KServe's versions).
    Without a `revision` the workers label the weights with their digest, which is the other
    arm's when it serves the same weights (an outside check: both arms read as one); with no
    `source` either, the digest of the weights it serves now. The other arms' revisions come
    from the run state where a reload set them (the workers' heartbeats tell them up to a
    heartbeat late), else from what their workers report. Returns the digest taken, if any."""
    others = [v for v in served.variants if v is not variant]
    if not others:
        return None
    loop = asyncio.get_running_loop()
    sources = state.read(cfg).sources
    taken = {}
    for v in others:
        reloaded = sources.get(v.unit)
        label = (reloaded["revision"] or await loop.run_in_executor(
            None, weights_label, reloaded["source"], cfg.model_root_paths)) if reloaded \
            else variants.revision(v, pool)
        if label:
            taken[label] = v.name
    if revision and revision in taken:
        raise ApiError("invalid_request", f"variant {taken[revision]!r} of "
                       f"{served.spec.name!r} serves revision {revision!r}; give this one "
                       "another", param="revision")
    if revision:
        return None
    digest = await loop.run_in_executor(None, weights_label,
                                        source or current_source(cfg, variant.unit),
                                        cfg.model_root_paths)
    if digest in taken:
        raise ApiError("invalid_request", f"variant {taken[digest]!r} of "
                       f"{served.spec.name!r} serves these weights as revision "
                       f"{digest!r}; give this variant a revision of its own, or move "
                       "traffic with the split's weights instead", param="revision")
    return digest


async def _reload(app: web.Application, hosts: list[WorkerLink], model: str, variant: Variant,
                  source: str, revision: str, digest: str | None) -> dict:
    cfg, pool = app[CONFIG], app[POOL]
    ticket = uuid.uuid4().hex
    timeout = cfg.admin.reload_timeout_s
    current = current_source(cfg, variant.unit)
    # Without a revision the workers label the new weights with their digest; when each took it
    # while loading, GET /admin/models showed a null standby until they were staged. Taken here
    # and sent, it shows from the start the revision the reload will serve as ("" where the
    # weights do not read: each worker then says why).
    label = revision or digest or await asyncio.get_running_loop().run_in_executor(
        None, weights_label, source or current, cfg.model_root_paths) or ""
    staged = await _ask(pool, hosts, lambda seq: Reload(seq, ticket, variant.unit, source,
                                                        label), timeout)
    if all(isinstance(r, ReloadDone) and r.status == ReloadStatus.OK for r in staged.values()):
        # The given revision only: a worker that restarts takes the digest of the weights then.
        state.update(cfg, lambda tree: tree["sources"].__setitem__(variant.unit, {
            "source": source or current, "revision": revision}))
        done = await _ask(pool, hosts, lambda seq: Commit(seq, ticket, variant.unit, True),
                          timeout)
        # (a worker whose commit failed answers no revision: not "" among them)
        revisions = sorted({r.revision for r in done.values()
                            if isinstance(r, ReloadDone) and r.revision})
        workers = _workers(done)
        for worker in workers:
            if not worker["ok"]:  # restarted meanwhile, say: it converges on the run state
                worker["message"] += ("; the run state records the new weights, which this "
                                      "worker loads and switches to by itself once it serves")
        return {"model": model, **({"variant": variant.name} if variant.name else {}),
                "revision": revisions[0] if len(revisions) == 1 else revisions,
                "workers": workers}
    # Drop everywhere: a worker that staged frees its standby, one still loading (it did not
    # answer in time) cancels, one that failed has nothing and says so.
    await _ask(pool, hosts, lambda seq: Commit(seq, ticket, variant.unit, False), timeout)
    failed = {i: r for i, r in staged.items()
              if not (isinstance(r, ReloadDone) and r.status == ReloadStatus.OK)}
    kinds = {_KIND_OF[r.status] if isinstance(r, ReloadDone) else "unavailable"
             for r in failed.values()}
    kind = next(k for k in _KINDS if k in kinds)
    details = "; ".join(f"worker {i}: {_text(r)}" for i, r in sorted(failed.items()))
    raise ApiError(kind, f"reload of {variant.unit} failed, the served revision is unchanged: "
                   f"{details}", param="source" if kind == "invalid_request" else None)


async def _ask(pool, links: list[WorkerLink], make, timeout: float
               ) -> dict[int, ReloadDone | BaseException]:
    """Send one message to each link and collect the answers, at most `timeout` seconds."""
    futures = {}
    for link in links:
        futures[link.index] = pool.submit(link, make(pool.next_seq()), 0, lambda: None)
    began = time.monotonic()
    if futures:
        await asyncio.wait(futures.values(), timeout=timeout)
    # This frontend stopped meanwhile (SIGSTOP, a loop busy for seconds): the answers may have
    # come and not been read; "no answer" alone blamed the worker (an outside check).
    late = time.monotonic() - began - timeout
    stalled = (f"; this frontend's event loop ran {late:.0f} s late, so an answer may have "
               "come unread" if late >= 1.0 else "")
    answers: dict[int, ReloadDone | BaseException] = {}
    for index, future in futures.items():
        if not future.done():
            future.add_done_callback(consume)
            answers[index] = TimeoutError(f"no answer within {timeout:g} s "
                                          f"(admin.reload_timeout_s){stalled}")
        else:
            answers[index] = future.exception() or future.result()
    return answers


def weights_label(source: str, roots: list) -> str | None:
    """The revision the workers give `source`'s weights without one: their digest (None where
    they do not read; the reload then says what is wrong with the source)."""
    try:
        return weights_revision(resolve_source(source, roots))
    except (ModelSourceError, OSError):
        return None


def _workers(answers: dict[int, ReloadDone | BaseException]) -> list[dict]:
    return [{"worker": i, "ok": isinstance(r, ReloadDone) and r.status == ReloadStatus.OK,
             "revision": r.revision if isinstance(r, ReloadDone) else None,
             "message": _text(r)} for i, r in sorted(answers.items())]


def _text(answer: ReloadDone | BaseException) -> str:
    if isinstance(answer, ReloadDone):
        return answer.message
    if isinstance(answer, WorkerGone):
        return f"lost during the reload ({answer})"
    return str(answer)
