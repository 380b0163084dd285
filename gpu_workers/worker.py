"""One worker process: loads the models, batches queued texts, runs forwards, answers.

Threads:
  * main    : the model loop below (batch formation, forward, outputs into shared memory);
  * sockets : `SocketThread`, all ZeroMQ I/O and heartbeats.
The socket thread hands requests over through `self._inbox` (a thread-safe queue); the model
thread pushes replies back through its own PUSH socket. Every Submit gets exactly one reply.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from gpu_workers.batcher import Batch, Limits, form_batch, wait_time
from gpu_workers.sockets import REPLIES, SocketThread
from shmserve import topology, wire
from shmserve.arena import Attachments
from shmserve.config import Config
from shmserve.models import inspect
from shmserve.protocol import (PROTOCOL_VERSION, Abort, Error, ErrorCode, Heartbeat, ModelInfo,
                               Ping, Result, Submit)

log = logging.getLogger("shmserve.worker")


@dataclass(slots=True, eq=False)
class Request:
    peer: bytes
    msg: Submit
    ids: np.ndarray
    offsets: np.ndarray
    out: np.ndarray
    arrived: float
    remaining: int
    started: float = 0.0
    inference_ms: float = 0.0
    batch_size: int = 0
    done: bool = False
    aborted: bool = False


@dataclass(slots=True, eq=False)
class QueuedText:
    request: Request
    index: int
    length: int
    model: str = field(init=False)
    priority: int = field(init=False)
    arrived: float = field(init=False)

    def __post_init__(self) -> None:
        self.model = self.request.msg.model
        self.priority = self.request.msg.priority
        self.arrived = self.request.arrived


class Worker:
    def __init__(self, cfg: Config, index: int) -> None:
        self.cfg = cfg
        self.index = index
        self.limits = Limits(cfg.batching.max_batch_size, cfg.batching.max_batch_tokens,
                             cfg.batching.max_wait_ms / 1000.0, cfg.batching.max_pad_ratio)
        self.specs = {m.name: inspect(m, roots=cfg.model_root_paths) for m in cfg.models}
        self.models: dict = {}
        self.device_label = "loading"
        self.ready = False
        self.stopping = threading.Event()
        self._inbox: queue.Queue[Request] = queue.Queue()
        self._queue: list[QueuedText] = []
        self._queued_texts = 0  # admitted, not yet answered; guarded by _lock
        self._lock = threading.Lock()
        self._requests: dict[tuple[bytes, int], Request] = {}
        self._attachments = Attachments()
        self._ctx = zmq.Context.instance()
        self._sockets = SocketThread(self._ctx, topology.worker_endpoint(cfg, index),
                                     self.on_submit, self.on_abort, self.heartbeat)
        self._push: zmq.Socket | None = None
        self._batches = 0

    # ---- socket thread side -------------------------------------------------------------

    def heartbeat(self, ping: Ping) -> Heartbeat:
        infos = tuple(ModelInfo(s.name, s.task, s.dim, s.max_tokens, s.dtype, s.revision)
                      for s in self.specs.values())
        return Heartbeat(PROTOCOL_VERSION, self.index, os.getpid(),
                         self.ready and not self.stopping.is_set(), self.device_label, infos,
                         self._queued_texts, self.cfg.workers.queue_texts, ping.sent_at)

    def on_submit(self, peer: bytes, msg: Submit) -> Error | None:
        if not self.ready or self.stopping.is_set():
            return Error(msg.seq, ErrorCode.UNAVAILABLE, "worker is loading or draining")
        if msg.model not in self.specs:
            return Error(msg.seq, ErrorCode.UNKNOWN_MODEL, f"model {msg.model!r} is not served")
        try:
            offsets = self._attachments.view(msg.offsets)
            ids = self._attachments.view(msg.token_ids)
            out = self._attachments.view(msg.output)
            n = offsets.shape[0] - 1
            if n < 1 or out.shape[0] != n or int(offsets[-1]) > ids.shape[0]:
                raise ValueError("offsets, ids and output disagree")
        except (OSError, ValueError) as exc:
            return Error(msg.seq, ErrorCode.INVALID, f"bad buffers: {exc}")
        limit = self.cfg.workers.queue_texts
        if msg.priority < 0:  # keep headroom for interactive work under a bulk flood
            limit = int(limit * self.cfg.workers.low_priority_queue_share)
        with self._lock:
            if self._queued_texts + n > limit:
                return Error(msg.seq, ErrorCode.OVERLOADED,
                             f"worker queue full ({self._queued_texts} texts queued); "
                             "raise workers.queue_texts or add workers")
            self._queued_texts += n
        request = Request(peer, msg, ids, offsets, out, time.time(), n)
        self._requests[(peer, msg.seq)] = request
        self._inbox.put(request)
        return None

    def on_abort(self, peer: bytes, msg: Abort) -> None:
        request = self._requests.get((peer, msg.seq))
        if request is not None:
            request.aborted = True  # the model thread answers it before its next batch

    # ---- model thread side --------------------------------------------------------------

    def load(self) -> None:
        import torch

        from gpu_workers.model import EmbeddingModel, device_name, pick_device

        device = pick_device(self.cfg.workers.torch_threads)
        for name, spec in self.specs.items():
            started = time.monotonic()
            self.models[name] = EmbeddingModel(spec, device)
            self._warm_up(self.models[name])
            log.info("worker.loaded", extra={"fields": {
                "model": name, "revision": spec.revision, "device": str(device),
                "seconds": round(time.monotonic() - started, 2),
                "torch_threads": torch.get_num_threads()}})
        self.device_label = device_name(device)

    def _warm_up(self, model) -> None:
        """Run the largest batch shape the limits allow, so the first request pays no warm-up."""
        longest = model.spec.max_tokens
        batch = max(1, min(self.limits.max_batch_size, self.limits.max_batch_tokens // longest))
        for shape in ((1, 8), (batch, longest)):
            model.forward(np.ones(shape, np.int64), np.full(shape[0], shape[1], np.int64))

    def serve(self) -> None:
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.connect(REPLIES)
        self._sockets.start()
        if not self._sockets.bound.wait(10):
            raise RuntimeError("socket thread did not bind within 10 s")
        self.load()
        self.ready = True
        log.info("worker.ready", extra={"fields": {"worker": self.index,
                                                    "device": self.device_label}})
        drain_deadline = None
        while True:
            if self._sockets.failure is not None:
                raise RuntimeError("socket thread failed") from self._sockets.failure
            if self.stopping.is_set() and drain_deadline is None:
                drain_deadline = time.time() + self.cfg.server.drain_timeout_s
                log.info("worker.draining", extra={"fields": {"queued": len(self._queue)}})
            self._take_inbox(block=not self._queue)
            now = time.time()
            self._drop_expired(now)
            if drain_deadline is not None and (not self._queue or now > drain_deadline):
                break
            if not self._queue:
                continue
            delay = wait_time(self._queue, now, self.limits)
            if delay > 0 and not self.stopping.is_set():
                self._take_inbox(block=True, timeout=delay)
                continue
            fair_turn = self._batches % self.cfg.batching.fair_share_every == 0
            batch, self._queue = form_batch(self._queue, self.limits, fair_turn)
            self._run(batch)
        self._fail_all(ErrorCode.UNAVAILABLE, "worker stopped before running this request")

    def _take_inbox(self, block: bool, timeout: float = 0.1) -> None:
        try:
            request = self._inbox.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return
        while True:
            lengths = np.diff(request.offsets)
            self._queue.extend(QueuedText(request, i, int(n)) for i, n in enumerate(lengths))
            try:
                request = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drop_expired(self, now: float) -> None:
        dropped = [t.request for t in self._queue if t.request.aborted or t.request.done
                   or (t.request.msg.deadline < now and not t.request.started)]
        if not dropped:
            return
        self._queue = [t for t in self._queue if not (t.request.aborted or t.request.done or (
            t.request.msg.deadline < now and not t.request.started))]
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

    def _run(self, batch: Batch[QueuedText]) -> None:
        texts = batch.texts
        ids = np.zeros((len(texts), batch.padded_len), np.int64)
        lengths = np.empty(len(texts), np.int64)
        for j, text in enumerate(texts):
            start, end = text.request.offsets[text.index], text.request.offsets[text.index + 1]
            ids[j, :end - start] = text.request.ids[start:end]
            lengths[j] = end - start
        began = time.time()
        for text in texts:
            if not text.request.started:
                text.request.started = began
        try:
            out = self.models[texts[0].model].forward(ids, lengths)
        except Exception as exc:  # noqa: BLE001 - one bad batch fails its requests, not the worker
            log.exception("forward failed")
            for request in {id(t.request): t.request for t in texts}.values():
                self._finish(request, Error(request.msg.seq, ErrorCode.INTERNAL,
                                            f"forward failed: {type(exc).__name__}"))
            return
        forward_ms = (time.time() - began) * 1000.0
        self._batches += 1
        touched = {}
        for j, text in enumerate(texts):
            request = text.request
            if request.done:
                continue
            request.out[text.index] = out[j]
            request.remaining -= 1
            touched[id(request)] = request
        for request in touched.values():
            request.inference_ms += forward_ms
            request.batch_size = max(request.batch_size, len(texts))
            if request.remaining == 0:
                msg = request.msg
                self._finish(request, Result(
                    msg.seq, (request.started - request.arrived) * 1000.0, request.inference_ms,
                    request.batch_size, int(request.offsets[-1])))
        log.debug("batch", extra={"fields": {
            "batch": self._batches, "texts": len(texts), "requests": len(touched),
            "real_tokens": batch.real_tokens, "padded_tokens": batch.padded_tokens,
            "forward_ms": round(forward_ms, 2),
            "request_ids": [r.msg.request_id for r in touched.values()]}})

    def _finish(self, request: Request, reply: Result | Error) -> None:
        request.done = True
        self._requests.pop((request.peer, request.msg.seq), None)
        with self._lock:
            self._queued_texts -= request.offsets.shape[0] - 1
        self._push.send_multipart([request.peer, *wire.encode(reply)])

    def _fail_all(self, code: ErrorCode, message: str) -> None:
        self._take_inbox(block=False)
        for request in {id(t.request): t.request for t in self._queue}.values():
            if not request.done:
                self._finish(request, Error(request.msg.seq, code, message))
        self._queue = []

    def close(self) -> None:
        self._sockets.stop()
        self._sockets.join(timeout=5)
        if self._push is not None:
            self._push.close(linger=1000)
        self._attachments.close()
        self._ctx.term()


def main(cfg: Config, index: int) -> int:
    worker = Worker(cfg, index)
    # Signal handlers only set a flag; the model loop drains and exits.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stopping.set())
    try:
        worker.serve()
    finally:
        worker.close()
    log.info("worker.stopped", extra={"fields": {"worker": index}})
    return 0
