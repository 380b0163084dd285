"""One worker process: loads the models, batches queued texts, runs forwards, answers.

Threads:
  * main    : the model loop below (batch formation, forward, outputs into shared memory, the
              model slots and their switches);
  * sockets : `SocketThread`, all ZeroMQ I/O, with `Intake` deciding what arrives (admission,
              aborts, heartbeats and news);
  * load-*, retry-* : a hot reload's new weights, a failed model's (slots, loading.Retries).
The socket thread hands requests, reloads and commits over through `Intake.inbox` (a
thread-safe queue), and so do loader threads their outcome; the model thread pushes replies
back through its own PUSH socket. Every Submit gets exactly one reply, as does every Reload and
Commit."""

from __future__ import annotations

import faulthandler
import functools
import logging
import queue
import threading
import time
from typing import Any, Callable

import zmq

from gpu_workers.batcher import Batch, FairTurns, Limits, form_pass, wait_time
from gpu_workers.device import DeviceLost, device_lost
from gpu_workers.intake import Intake, Status, Unwell
from gpu_workers.loading import (Retried, Retries, back_off, describe, load_again,
                                 load_hosted, load_replacement, log_loaded, on_a_nicer_thread,
                                 unloaded_at_start)
from gpu_workers.memory import MemoryCare, Policy, TorchAllocator, forward_in_halves
from gpu_workers.metrics import WorkerMetrics
from gpu_workers.requests import QueuedText, Request, mark_running, model_inputs, write_rows
from gpu_workers.slots import Built, Orphaned, Slots, hosted_configs
from gpu_workers.sockets import ANNOUNCE, REPLIES, SocketThread
from shmserve import state, topology, wire
from shmserve.config import Config, ModelConfig
from shmserve.models import ModelSourceError, ModelSpec, inspect
from shmserve.protocol import Commit, Error, ErrorCode, ModelInfo, Reload, Result

log = logging.getLogger("shmserve.worker")

RECONCILE_S = 1.0  # how often the model loop compares its units with the run state


class Worker:
    def __init__(self, cfg: Config, index: int) -> None:
        self.cfg = cfg
        self.index = index
        self.limits = Limits.of(cfg.batching)
        self.configs = hosted_configs(cfg, index)
        # Files that do not read (weights deleted) fail a load as weights that do not fit do
        # (load): the worker exited here, before any heartbeat (an outside check).
        self.specs: dict[str, ModelSpec] = {}
        self._unreadable: list[tuple[str, Exception]] = []  # (model, error)
        for name, config in self.configs.items():
            try:
                self.specs[name] = inspect(config, roots=cfg.model_root_paths)
            except ModelSourceError as exc:
                self._unreadable.append((name, exc))
        self.slots: Slots | None = None  # once the device is known
        self.device: Any = None
        self.status = Status(tuple(ModelInfo(s.name, s.task, s.dim, s.max_tokens, s.dtype, "",
                                             "loading", s.revision)
                                   for s in self.specs.values()))
        self.stopping = threading.Event()
        self.metrics = WorkerMetrics(index, hosts=self.configs)
        self.intake = Intake(cfg, index, self.specs, self.metrics, self.stopping, self.status)
        self._queue: list[QueuedText] = []
        self._ctx = zmq.Context.instance()
        intake = self.intake
        self._sockets = SocketThread(self._ctx, topology.worker_endpoint(cfg, index),
                                     intake.on_submit, intake.on_abort, intake.heartbeat,
                                     intake.on_control, intake.tick, intake.news, index,
                                     intake.announcement)
        self._push: zmq.Socket | None = None
        # Replies not yet sent, by frontend: a batch's go out as one message each (wire).
        self._outbox: dict[bytes, list[bytes]] = {}
        self._batches = 0
        self._turns = FairTurns(cfg.batching.fair_share_every)
        self._state = state.Watch(cfg)  # the run state, reconciled every RECONCILE_S
        self._reconciled = 0.0
        self.metrics.set_ready(False)
        self.memory: MemoryCare | None = None  # once the device is known
        self.retries: Retries | None = None  # models that did not load, once some did

    def load(self) -> None:
        from gpu_workers.device import device_name, pick_device

        w = self.cfg.workers
        device = topology.worker_devices(self.cfg)[self.index]
        self.device = pick_device(w.torch_threads, w.cudnn_attention,
                                  gpu="" if device == topology.CPU else device,
                                  fallback=w.cpu_fallback)
        self.slots = Slots(self._build, self._release, self.intake.inbox.put,
                           self.cfg.admin.reload_timeout_s, self.metrics.reconciled)
        failures, self._unreadable = self._unreadable, []
        for name, outcome in load_hosted(self.cfg, self.index, self.specs, self.configs,
                                         self.device, self.limits, self.intake.backlog.seed):
            if isinstance(outcome, Exception):
                failures.append((name, outcome))
            else:
                self._add(name, *outcome)
        if failures and not self.slots.units:  # none loaded: the worker exits (back_off)
            self.status.unloaded = unloaded_at_start(self.cfg, self.index, self.configs, failures)
            raise failures[0][1]
        self.retries = Retries(functools.partial(load_again, self.cfg, self.index,
                                                 device=self.device, limits=self.limits),
                               self.intake.inbox.put, self.metrics.load_failed)
        for name, exc in failures:  # some did: it serves them, and tries these again
            self.retries.failed(name, describe(exc))
        if failures:
            failures.clear()  # (their tracebacks held what those loads had built)
            self._release()
        self.status.unloaded = self.retries.unloaded()
        self.status.device_label = device_name(self.device)
        self.status.infos = self.slots.infos()
        self.memory = MemoryCare(TorchAllocator(self.device), self.metrics,
                                 w.memory_check_batches, w.heartbeat_interval_s, Policy.of(w))

    def _add(self, name: str, config: ModelConfig, model: Any, seconds: float) -> None:
        """A model loaded (at the start, or tried again: Retries) into its slot, and said."""
        spec = model.spec
        self.configs[name], self.specs[name] = config, spec
        self.slots.add(config, spec, model)
        log_loaded(name, model, self.device, seconds)
        self.metrics.model_loaded(name, spec.revision, spec.dtype, str(self.device))

    def _retried(self, item: Retried) -> None:
        """A retry's outcome (model thread): the model served from now on (off the unloaded
        before _slots_do announces it: a heartbeat with it in both read as "degraded" until
        the next, an outside check), or its wait again."""
        def done() -> list:
            if item.loaded is not None:
                self._add(item.name, *item.loaded)
            self.retries.done(item)
            self.status.unloaded = self.retries.unloaded()
            return []
        self._slots_do(done)
        if item.loaded is None:
            self._release()  # what the failed load held

    def _release(self) -> None:
        """After a reload or an unload dropped a model: its memory back to the device."""
        from gpu_workers.device import release

        if release(self.device):
            self.metrics.emptied("reload")
            log.info("worker.empty_cache", extra={"fields": {"reason": "reload"}})

    def _build(self, config: ModelConfig, active: ModelSpec) -> tuple[ModelSpec, Any]:
        """A reload's new slot (gpu_workers.loading.load_replacement), on its loader thread,
        which yields the cores to the model thread serving meanwhile (workers.reload_nice)."""
        from gpu_workers.device import yield_cores

        log.info("worker.reload_loading", extra={"fields": {
            "model": active.name, "nice": yield_cores(self.cfg.workers.reload_nice)}})
        model = load_replacement(config, active, self.cfg.model_root_paths, self.device,
                                 self.cfg.workers.cuda_graphs, self.limits)
        return model.spec, model

    def serve(self) -> None:
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.connect(REPLIES)
        self._sockets.start()
        if not self._sockets.bound.wait(10):
            raise RuntimeError("socket thread did not bind within 10 s")
        # Heartbeats answer from now on: a hang is the frontends' to see (workers.hung_kill_s)
        faulthandler.cancel_dump_traceback_later()  # workers.start_timeout_s (gpu_workers.__main__)
        try:
            on_a_nicer_thread(self.load, self.cfg.workers.reload_nice)
        except Exception as exc:
            back_off(self.cfg, self.index, exc, self.status, self.stopping)
            raise  # the process exits (worker.failed); supervisord starts it again
        state.clear_load_failures(self.cfg, self.index)
        self.status.ready = True
        # Every frontend hears it at once, not at its next ping: /ready, judged by each from its
        # own heartbeats, said ready from one and loading from the other for up to a ping
        # interval, and nginx alternates probes between them (an outside check).
        self._push.send(ANNOUNCE)
        self.metrics.set_ready(True)
        log.info("worker.ready", extra={"fields": {"worker": self.index,
                                                    "device": self.status.device_label}})
        drain_deadline = None
        while True:
            if self._sockets.failure is not None:
                raise RuntimeError("socket thread failed") from self._sockets.failure
            if self.intake.unwell:
                self._leave(f"worker {self.index} restarting: {self.intake.unwell}")
                raise Unwell(self.intake.unwell)
            if self.stopping.is_set() and drain_deadline is None:
                drain_deadline = time.time() + self.cfg.server.drain_timeout_s
                self._push.send(ANNOUNCE)  # not ready from now on, to every frontend at once
                self.metrics.set_ready(False)
                log.info("worker.draining", extra={"fields": {"queued": len(self._queue)}})
            self._take_inbox(block=not self._queue)
            now = time.time()
            self._drop_expired(now)
            if drain_deadline is None and time.monotonic() - self._reconciled >= RECONCILE_S:
                self._reconciled = time.monotonic()
                self._slots_do(lambda: self.slots.expire(self._reconciled)
                               + self.slots.reconcile(self._state.current().sources))
                if self.retries:
                    self.retries.start_due(self._state.current().sources)
                    self.status.unloaded = self.retries.unloaded()
            if drain_deadline is not None and (not self._queue or now > drain_deadline):
                break
            if not self._queue:
                self.memory.idle(now)
                continue
            delay = wait_time(self._queue, now, self.limits, self.intake.arrivals.gap_s)
            if delay > 0 and not self.stopping.is_set():
                self._take_inbox(block=True, timeout=delay)
                continue
            oldest = self._queue[0]
            batches, self._queue = form_pass(self._queue, self.limits, self._turns.next(),
                                             _packs)
            self._turns.ran(oldest, self._queue)
            del oldest  # a request's text, held past the pass as `batches` is (below)
            self._run(batches, backlogged=bool(self._queue))
            del batches  # their requests' views: a gone frontend's arena unmaps now, not at
            self._collect()  # the next pass (an outside check: 241 MB held at idle)
        self._fail_all(ErrorCode.UNAVAILABLE, "worker stopped before running this request")

    def _take_inbox(self, block: bool, timeout: float = 0.1) -> None:
        try:
            item = self.intake.inbox.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return
        while True:
            if isinstance(item, Request):
                # Pinned to the slot active now: its texts all run on these weights.
                item.slot = self.slots.active(item.msg.model)
                self._queue.extend(QueuedText(item, i, n)
                                   for i, n in enumerate(item.lengths.tolist()))
            else:
                self._control(item)
            try:
                item = self.intake.inbox.get_nowait()
            except queue.Empty:
                return

    def _control(self, item: tuple[bytes, Reload | Commit] | Built | Retried | Orphaned
                 ) -> None:
        """Reload, Commit, loader outcomes and gone frontends: between two batches, on the
        model thread."""
        slots = self.slots
        if isinstance(item, Built):
            self._slots_do(lambda: slots.built(item))
        elif isinstance(item, Retried):
            self._retried(item)
        elif isinstance(item, Orphaned):
            self._slots_do(lambda: slots.reconcile(self._state.current().sources)
                           + slots.orphaned(item.peer))
        elif isinstance(item[1], Reload):
            self._slots_do(lambda: slots.reload(*item))
        else:
            self._slots_do(lambda: slots.commit(*item))

    def _slots_do(self, change: Callable[[], list[tuple[bytes, Any]]]) -> None:
        """A change of the slots' table, then what it takes: a switch's metrics and the
        retired slots freed, the frontends told of any change (heartbeats' model infos; also
        a standby expired: /admin/models said staged for ever, an outside check), replies."""
        before = {name: unit.active.spec for name, unit in self.slots.units.items()}
        replies = change()
        switched = False
        for name, unit in self.slots.units.items():
            if name in before and unit.active.spec is not before[name]:
                self.metrics.model_switched(name, before[name], unit.active.spec,
                                            str(self.device))
                switched = True
        if switched:
            self._collect()
        infos, self.status.infos = self.status.infos, self.slots.infos()
        if infos != self.status.infos:  # before the replies: the frontend that asked hears it
            self._push.send(ANNOUNCE)  # first (gpu_workers.sockets.SocketThread._announce)
        for peer, reply in replies:
            self._push.send_multipart([peer, *wire.encode(reply)])

    def _collect(self) -> None:
        if any(unit.retiring for unit in self.slots.units.values()):
            self.slots.collect({t.request.slot.key for t in self._queue})

    def _drop_expired(self, now: float) -> None:
        dropped = [t.request for t in self._queue if t.request.aborted or t.request.done
                   or (t.request.msg.deadline < now and not t.request.started)]
        if not dropped:
            return
        self._queue = [t for t in self._queue if not (t.request.aborted or t.request.done or (
            t.request.msg.deadline < now and not t.request.started))]
        self._collect()
        for request in {id(r): r for r in dropped}.values():
            if request.done:
                continue
            reason = "aborted" if request.aborted else "deadline"
            log.info("request.dropped", extra={"fields": {
                "request_id": request.msg.request_id, "reason": reason,
                "texts": request.remaining}})
            if request.aborted:
                self._finish(request, Error(request.msg.seq, ErrorCode.ABORTED, "aborted"))
            else:
                self._finish(request, Error(request.msg.seq, ErrorCode.DEADLINE,
                                            "deadline passed while queued"))
        self._send_replies()

    def _run(self, batches: list[Batch[QueuedText]], backlogged: bool = False) -> None:
        """One forward pass over `batches` (length groups of one slot; several only for a
        model that packs them, see gpu_workers.packed); `backlogged`: texts wait behind it."""
        texts = [text for batch in batches for text in batch.texts]
        slot = texts[0].request.slot  # the batcher never mixes slots
        groups = model_inputs(batches, texts)
        began = time.time()
        for text in texts:
            if not text.request.started:
                text.request.started = began
        # The batcher never mixes per-token, raw or differently skipping requests either
        msg = texts[0].request.msg
        per_token = msg.per_token
        forward = (functools.partial(slot.model.forward_groups, tokens=True) if per_token
                   else functools.partial(slot.model.forward_groups, normalize=not msg.raw,
                                          skip=msg.skip) if msg.raw or msg.skip
                   else slot.model.forward_groups)
        mark_running(texts)
        self.status.pass_began = time.monotonic()
        try:
            out, ok = forward_in_halves(forward, groups, self.memory.after_oom, per_token)
            if out is not None and out.shape[-1] != (width := slot.spec.width(per_token)):
                # rows the requests' buffers cannot take: an error of this server's, which
                # failed the worker at the copy (a model of several poolings' /embed_all)
                raise ValueError(f"the model's rows are {out.shape[-1]} wide, not {width}")
        except Exception as exc:  # noqa: BLE001 - one bad batch fails its requests, not the worker
            failed = {id(t.request): t.request for t in texts}.values()
            log.exception("forward failed", extra={"fields": {
                "request_ids": [r.msg.request_id for r in failed]}})
            for request in failed:
                self._finish(request, Error(request.msg.seq, ErrorCode.INTERNAL,
                                            f"forward failed: {type(exc).__name__}"))
            self._send_replies()
            if device_lost(exc):
                # The batch that met it is answered (it may be what caused it: not sent to
                # another worker); what waits goes to the other workers, and this one exits
                # for supervisord to start again.
                self._leave("worker restarting after a device error")
                raise DeviceLost(f"{type(exc).__name__}: {exc}") from exc
            return
        finally:
            self.status.pass_began = 0.0
        forward_ms = (time.time() - began) * 1000.0
        self._batches += 1
        touched, computed = write_rows(out, ok, texts, per_token, slot.spec.dtype, self._finish)
        for priority, tokens in computed.items():
            self.intake.backlog.done(priority, tokens)
        news = False
        for request in touched.values():
            request.inference_ms += forward_ms
            request.batch_size = max(request.batch_size, len(texts))
            if request.remaining == 0:
                msg = request.msg
                # Its time here not in its passes: before the first and between them (a
                # request's texts may run in several passes, behind others' passes)
                waited = max(0.0, (time.time() - request.arrived) * 1000.0 - request.inference_ms)
                self._finish(request, Result(
                    msg.seq, waited, request.inference_ms, request.batch_size,
                    int(request.offsets[-1]), slot.spec.revision))
                news = news or self.intake.newsworthy(int(request.offsets[-1]))
        if news:  # before the replies: every frontend hears it before a client can send again
            self._push.send(ANNOUNCE)
        self._send_replies()
        # After the replies, so observing never delays them.
        real = sum(batch.real_tokens for batch in batches)
        padded = sum(batch.padded_tokens for batch in batches)
        if backlogged:  # the speed a queue drains at (shmserve.admission)
            self.intake.backlog.passed(real, forward_ms / 1000.0)
        self.metrics.batch(slot.spec.name, slot.spec.revision, len(touched), len(texts), real,
                           padded, forward_ms / 1000.0)
        self.metrics.set_queue_depth(self.intake.queued_texts)
        if self.cfg.logging.batch_log:
            log.info("batch", extra={"fields": {
                "batch": self._batches, "model": slot.spec.name, "revision": slot.spec.revision,
                "requests": len(touched), "texts": len(texts), "groups": len(batches),
                "real_tokens": real,
                "padded_tokens": padded, "forward_ms": round(forward_ms, 3),
                "request_ids": [r.msg.request_id for r in touched.values()]}})
        self.memory.after_batch(time.time())

    def _finish(self, request: Request, reply: Result | Error) -> None:
        request.done = True
        self.intake.finished(request)
        self._outbox.setdefault(request.peer, []).extend(wire.encode(reply))

    def _send_replies(self) -> None:
        """Send every reply `_finish` queued: one message per frontend, (kind, body) pairs."""
        outbox, self._outbox = self._outbox, {}
        for peer, frames in outbox.items():
            self._push.send_multipart([peer, *frames])

    def _leave(self, message: str) -> None:
        """Before an exit for supervisord to start this worker afresh (DeviceLost, Unwell): not
        ready, said to every frontend at once, and what it holds handed back UNAVAILABLE, which
        the frontends send to another worker."""
        self.status.ready = False
        self.metrics.set_ready(False)
        self._push.send(ANNOUNCE)
        self._fail_all(ErrorCode.UNAVAILABLE, message)

    def _fail_all(self, code: ErrorCode, message: str) -> None:
        self._take_inbox(block=False)
        for request in {id(t.request): t.request for t in self._queue}.values():
            if not request.done:
                self._finish(request, Error(request.msg.seq, code, message))
        self._send_replies()
        self._queue = []

    def close(self, answered: bool = True) -> None:
        """`answered`: every request taken was answered or never ran (protocol.Closing)."""
        self.stopping.set()  # whatever the socket thread still reads is refused
        self._sockets.stop(answered)
        self._sockets.join(timeout=5)
        if self._push is not None:
            self._push.close(linger=1000)
        self.intake.attachments.close()
        self._ctx.term()


def _packs(text: QueuedText) -> bool:
    """Whether the pass `text` starts may merge length groups (its model packs them)."""
    return text.request.slot.model.packs
