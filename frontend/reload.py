"""A hot reload, driven by the frontend that received the admin call, over its DEALER sockets to
every worker that hosts the model (or the A/B variant):

  1. Reload(ticket, revision): each worker loads and warms the new weights into a standby slot
     while its active slot keeps serving, and answers once staged, or why it could not. The
     revision is the given one, else the weights' digest, taken here as a worker takes it.
  2. If every worker staged: the run state records the new source (so a worker that restarts
     loads it too), then Commit(keep): each switches between two batches and answers. Else
     Commit(drop) to those that staged: nothing changed anywhere, and the call says why.

So a model switches on every worker or on none. Each phase waits at most
admin.reload_timeout_s; a worker that does not answer in time counts as failed. Every frontend
learns the new revision from the replies it gets (Result.revision) and from heartbeats.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from aiohttp import web

from frontend import metrics
from frontend.app import CONFIG, POOL
from frontend.errors import ApiError
from frontend.links import WorkerGone, WorkerLink, consume
from frontend.variants import Variant
from shmserve import state, topology
from shmserve.models import (ModelSourceError, hosted, resolve_source, units, weights_digest,
                             weights_file)
from shmserve.protocol import Commit, Reload, ReloadDone, ReloadStatus

# The call's error is the first of these kinds among the workers' answers: a bad source first
# (the caller can fix it), then a reload already in progress, then the workers' own failures.
_KINDS = ("invalid_request", "conflict", "internal_error", "unavailable")
_KIND_OF = {ReloadStatus.INVALID: "invalid_request", ReloadStatus.BUSY: "conflict",
            ReloadStatus.FAILED: "internal_error"}


async def reload(app: web.Application, model: str, variant: Variant, source: str,
                 revision: str, digest: str | None = None) -> dict:
    """Reload `variant` of `model` everywhere; the answer body, or an ApiError. `digest`: the
    new weights' digest where the caller took it already (it labels them without a
    `revision`). Counted by outcome, and a success timed (metrics.RELOADS, RELOAD_SECONDS:
    reloads showed only as admin requests, an outside check)."""
    started = time.monotonic()
    try:
        answer = await _reload_hosts(app, model, variant, source, revision, digest)
    except ApiError as exc:
        metrics.RELOADS.labels(variant.unit, exc.kind).inc()
        raise
    metrics.RELOADS.labels(variant.unit, "ok").inc()
    metrics.RELOAD_SECONDS.labels(variant.unit).observe(time.monotonic() - started)
    return answer


async def _reload_hosts(app: web.Application, model: str, variant: Variant, source: str,
                        revision: str, digest: str | None) -> dict:
    cfg, pool = app[CONFIG], app[POOL]
    devices = topology.worker_devices(cfg)
    hosts = [link for link in pool.links
             if any(u.name == variant.unit for u in hosted(cfg, devices, link.index))]
    down = [link.index for link in hosts if not link.ready]
    if down:
        raise ApiError("unavailable", f"workers {down} host {variant.unit} and are not ready; "
                       "reload once GET /ready answers 200", retry_after=1)
    try:
        with state.reloading(cfg, variant.unit):
            return await _reload(app, hosts, model, variant, source, revision, digest)
    except state.Busy:
        raise ApiError("conflict", f"a reload of {variant.unit} is already in progress (another "
                       "admin call); the served revision is unchanged by this one") from None


async def _reload(app: web.Application, hosts: list[WorkerLink], model: str, variant: Variant,
                  source: str, revision: str, digest: str | None) -> dict:
    cfg, pool = app[CONFIG], app[POOL]
    ticket = uuid.uuid4().hex
    timeout = cfg.admin.reload_timeout_s
    current = state.read(cfg).sources.get(variant.unit, {}).get("source") or next(
        u.config.source for m in cfg.models for u in units(m) if u.name == variant.unit)
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
        revisions = sorted({r.revision for r in done.values() if isinstance(r, ReloadDone)})
        return {"model": model, **({"variant": variant.name} if variant.name else {}),
                "revision": revisions[0] if len(revisions) == 1 else revisions,
                "workers": _workers(done)}
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
    if futures:
        await asyncio.wait(futures.values(), timeout=timeout)
    answers: dict[int, ReloadDone | BaseException] = {}
    for index, future in futures.items():
        if not future.done():
            future.add_done_callback(consume)
            answers[index] = TimeoutError(f"no answer within {timeout:g} s "
                                          "(admin.reload_timeout_s)")
        else:
            answers[index] = future.exception() or future.result()
    return answers


def weights_label(source: str, roots: list) -> str | None:
    """The revision the workers give `source`'s weights without one: their digest (None where
    they do not read; the reload then says what is wrong with the source)."""
    try:
        return weights_digest(weights_file(resolve_source(source, roots)))
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
