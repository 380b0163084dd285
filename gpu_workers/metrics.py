"""Prometheus metrics of a worker process, observed by the model thread once per batch.

Nothing here runs per request: the frontends observe each request's stages from its Result.
Gauges are written by one worker each (label ``worker``) in "livemostrecent" mode: a restarted
worker's first value wins at once, and `shmserve.reaper` removes the dead process's files.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

from shmserve import metrics as shared
from shmserve.models import ModelSpec

_WM = ["worker", "model"]

BATCH_REQUESTS = Histogram("shmserve_batch_requests", "Requests with texts in a batch", _WM,
                           buckets=shared.COUNT_BUCKETS)
BATCH_TEXTS = Histogram("shmserve_batch_texts", "Texts in a batch", _WM,
                        buckets=shared.COUNT_BUCKETS)
BATCH_TOKENS = Histogram("shmserve_batch_tokens", "Real (unpadded) tokens in a batch", _WM,
                         buckets=shared.TOKEN_BUCKETS)
BATCH_PADDING = Histogram("shmserve_batch_padding_ratio", "Padded tokens / real tokens of a "
                          "batch (1: no padding)", _WM, buckets=shared.RATIO_BUCKETS)
PADDED_TOKENS = Counter("shmserve_batch_padded_tokens_total",
                        "Tokens the forwards computed, padding included", _WM)
FORWARD = Histogram("shmserve_batch_forward_seconds", "Time of one forward pass, outputs on "
                    "the host", _WM, buckets=shared.LATENCY_BUCKETS)
QUEUE_DEPTH = Gauge("shmserve_worker_queue_depth", "Texts admitted and not yet answered",
                    ["worker"], multiprocess_mode="livemostrecent")
READY = Gauge("shmserve_worker_ready", "1 while the worker serves, 0 while loading, draining "
              "or not running",
              ["worker"], multiprocess_mode="livemostrecent")
MODEL_INFO = Gauge("shmserve_model_info", "1 for each model a worker serves; the labels say "
                   "which weights (revision: a digest of them, or the configured one)",
                   ["worker", "model", "revision", "dtype", "device"],
                   multiprocess_mode="livemostrecent")
DEVICE_ALLOCATED = Gauge("shmserve_worker_device_allocated_bytes",
                         "Device memory held by tensors", ["worker"],
                         multiprocess_mode="livemostrecent")
DEVICE_RESERVED = Gauge("shmserve_worker_device_reserved_bytes",
                        "Device memory held by the caching allocator", ["worker"],
                        multiprocess_mode="livemostrecent")
DEVICE_PEAK = Gauge("shmserve_worker_device_peak_allocated_bytes",
                    "Most device memory held by tensors since the worker started", ["worker"],
                    multiprocess_mode="livemostrecent")
DEVICE_FREE = Gauge("shmserve_worker_device_free_bytes",
                    "The device's free memory as the driver reports it (every process on it)",
                    ["worker"], multiprocess_mode="livemostrecent")
FRAGMENTATION = Gauge("shmserve_worker_device_fragmentation_ratio",
                      "Share of reserved device memory in free pieces of segments that also "
                      "hold live tensors (inactive split bytes / reserved), at the last check",
                      ["worker"], multiprocess_mode="livemostrecent")
EMPTY_CACHE = Counter("shmserve_worker_empty_cache_total",
                      "torch.cuda.empty_cache() calls, by reason: pressure (the device's free "
                      "memory under workers.empty_cache_free_below), idle, oom (before a retry), "
                      "reload (a replaced or unloaded model's memory)",
                      ["worker", "reason"])
EMPTY_CACHE_REASONS = ("pressure", "idle", "oom", "reload")
FRONTEND_HUNG_KILLS = Counter("shmserve_frontend_hung_kills_total",
                              "Frontends a worker SIGKILLed after frontends.hung_kill_s without "
                              "their pings (gpu_workers.watch); several workers may count one: "
                              "use max by (frontend)", ["worker", "frontend"])
REFUSED = Counter("shmserve_worker_refused_total",
                  "Requests a worker refused at admission (429), by reason: queue_full "
                  "(workers.queue_texts), deadline (the queue ahead would not let it finish in "
                  "time: workers.refuse_past_deadline)", ["worker", "reason"])
REFUSED_REASONS = ("queue_full", "deadline")
RECONCILES = Counter("shmserve_worker_reconciles_total",
                     "Models a worker switched to what the run state (state.json) records "
                     "without a reload's commit, by outcome: standby (to the weights a reload "
                     "had staged), loaded (loaded them itself), failed (they did not load)",
                     ["worker", "model", "outcome"])
RECONCILE_OUTCOMES = ("standby", "loaded", "failed")
LOAD_FAILURES = Counter("shmserve_worker_model_load_failures_total",
                        "Loads of a model that failed on a worker serving its other models "
                        "(it tries again: README, Reliability, \"A model that fails to load\")",
                        ["worker", "model"])

# Triton's statistics extension (frontend.stats), hidden from /metrics (shmserve.metrics.
# HIDDEN_PREFIX): the passes by unit (MODEL or MODEL@VARIANT), revision and texts in the pass
# (Triton's batch size), and their forwards' time (outputs on the host).
STATS_EXECUTIONS = Counter("shmserve_stats_executions_total", "Passes by batch size",
                           ["model", "revision", "batch_size"])
STATS_EXECUTION_SECONDS = Counter("shmserve_stats_execution_seconds_total",
                                  "Passes' time by batch size", ["model", "revision", "batch_size"])

# Written only by workers on a GPU: a CPU deployment does not expose them.
DEVICE_ONLY = ("shmserve_worker_device_allocated_bytes", "shmserve_worker_device_reserved_bytes",
               "shmserve_worker_device_peak_allocated_bytes", "shmserve_worker_device_free_bytes",
               "shmserve_worker_device_fragmentation_ratio")


class WorkerMetrics:
    """One worker's series, with the labelled children looked up once, not per batch."""

    def __init__(self, worker: int, hosts: Iterable[str] = ()) -> None:
        self.worker = str(worker)
        self._batch: dict[str, tuple] = {}
        self._executions: dict[tuple[str, str, int], tuple] = {}  # (unit, revision, size)
        self._queue = QUEUE_DEPTH.labels(self.worker)
        self._ready = READY.labels(self.worker)
        # Exposed at 0 from the start.
        self._empty_cache = {r: EMPTY_CACHE.labels(self.worker, r) for r in EMPTY_CACHE_REASONS}
        self._refused = {r: REFUSED.labels(self.worker, r) for r in REFUSED_REASONS}
        for model in hosts:  # the units it is to load, even one that never loads here
            LOAD_FAILURES.labels(self.worker, model)

    def set_ready(self, ready: bool) -> None:
        self._ready.set(1 if ready else 0)

    def set_queue_depth(self, texts: int) -> None:
        self._queue.set(texts)

    def model_loaded(self, model: str, revision: str, dtype: str, device: str) -> None:
        MODEL_INFO.labels(self.worker, model, revision, dtype, device).set(1)
        self._children(model)  # its batch series exist, at zero, before the first batch
        for outcome in RECONCILE_OUTCOMES:  # and these (an alert on increase() sees the first)
            RECONCILES.labels(self.worker, model, outcome)

    def load_failed(self, model: str) -> None:
        LOAD_FAILURES.labels(self.worker, model).inc()

    def reconciled(self, model: str, outcome: str) -> None:
        RECONCILES.labels(self.worker, model, outcome).inc()

    def model_switched(self, model: str, old: ModelSpec, new: ModelSpec, device: str) -> None:
        """A hot reload replaced the weights: the old revision's info series drops to 0. Each
        series keeps its own dtype label: with dtype auto, old and new weights may differ."""
        MODEL_INFO.labels(self.worker, model, old.revision, old.dtype, device).set(0)
        MODEL_INFO.labels(self.worker, model, new.revision, new.dtype, device).set(1)

    def _children(self, model: str) -> tuple:
        children = self._batch.get(model)
        if children is None:
            children = self._batch[model] = tuple(
                m.labels(self.worker, model) for m in (BATCH_REQUESTS, BATCH_TEXTS, BATCH_TOKENS,
                                                       BATCH_PADDING, PADDED_TOKENS, FORWARD))
        return children

    def batch(self, model: str, revision: str, requests: int, texts: int, real_tokens: int,
              padded_tokens: int, forward_s: float) -> None:
        key = (model, revision, texts)
        executions = self._executions.get(key)
        if executions is None:
            executions = self._executions[key] = (
                STATS_EXECUTIONS.labels(model, revision, str(texts)),
                STATS_EXECUTION_SECONDS.labels(model, revision, str(texts)))
        executions[0].inc()
        executions[1].inc(forward_s)
        requests_h, texts_h, tokens_h, padding_h, padded_c, forward_h = self._children(model)
        requests_h.observe(requests)
        texts_h.observe(texts)
        tokens_h.observe(real_tokens)
        padding_h.observe(padded_tokens / max(real_tokens, 1))
        padded_c.inc(padded_tokens)
        forward_h.observe(forward_s)

    def emptied(self, reason: str) -> None:
        self._empty_cache[reason].inc()

    def refused(self, reason: str) -> None:
        self._refused[reason].inc()

    def watching(self, frontend: int) -> None:
        """Frontend `frontend`'s kill count exists, at zero, before its first kill (an alert on
        increase() missed the first one)."""
        FRONTEND_HUNG_KILLS.labels(self.worker, str(frontend))

    def frontend_killed(self, frontend: int) -> None:
        FRONTEND_HUNG_KILLS.labels(self.worker, str(frontend)).inc()

    def device_memory(self, reading) -> None:
        """A gpu_workers.memory.Reading."""
        DEVICE_ALLOCATED.labels(self.worker).set(reading.allocated)
        DEVICE_RESERVED.labels(self.worker).set(reading.reserved)
        DEVICE_PEAK.labels(self.worker).set(reading.peak)
        DEVICE_FREE.labels(self.worker).set(reading.free)
        FRAGMENTATION.labels(self.worker).set(reading.fragmentation)
