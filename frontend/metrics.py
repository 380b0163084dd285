"""Prometheus metrics of a frontend process, aggregated over all processes at scrape time.

supervisord sets PROMETHEUS_MULTIPROC_DIR for every program (``shmserve up`` empties it), so
prometheus_client writes each process's values to files there and `/metrics` sums them (see
`shmserve.metrics`). Labels stay low-cardinality: route (the matched route, not the path), model
(a configured name), status, stage, frontend and worker indices.
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import Counter, Gauge, Histogram

from shmserve import metrics as shared
from shmserve.metrics import Children, Turn
from shmserve import processes
from shmserve.arena import SHM_DIR
from shmserve.config import Config

# Stages of one request; each is a disjoint part of the total, so they never add up to more than
# it: tokenize (frontend), handoff (tokens ready to the reply back in the handler, less the
# worker's queue and inference: the trips over ZeroMQ both ways and the waits for either
# process's loop), queue (worker: arrival to its first batch, and between its batches),
# inference (worker: the forwards its texts ran in), transfer (frontend: reply arrival to the
# response rendered), total (the frontend's whole handling, as X-Total-Time).
STAGES = ("tokenize", "handoff", "queue", "inference", "transfer", "total")

REQUESTS = Counter("shmserve_requests_total", "HTTP requests answered by the frontends",
                   ["route", "model", "status", "revision"])  # revision: of the weights that
                                                             # served it ("" without inference)
LATENCY = Histogram("shmserve_request_duration_seconds",
                    "Time from the frontend receiving a request to its response, by its "
                    "status (status=~\"2..\": the answered requests'; under overload the fast "
                    "429s are most of the count)",
                    ["route", "model", "status"], buckets=shared.LATENCY_BUCKETS)
STAGE = Histogram("shmserve_stage_duration_seconds",
                  "Time of each stage of successful inference requests (every task)",
                  ["stage", "model"], buckets=shared.LATENCY_BUCKETS)
GRPC_CALLS = Counter("shmserve_grpc_calls_total",
                     "gRPC calls answered by the frontends (server.grpc_port), by method and "
                     "gRPC status code; each call's HTTP request counts in "
                     "shmserve_requests_total too", ["method", "code"])
INFLIGHT = Gauge("shmserve_frontend_inflight_requests", "Requests being served per frontend",
                 ["frontend"], multiprocess_mode="livesum")
KEYS_FILE_REFUSED = Gauge("shmserve_api_keys_file_refused", "1 while auth.api_keys_file, "
                          "changed on disk, does not load (the keys read before stay in force), "
                          "per frontend", ["frontend"], multiprocess_mode="livemax")
ARENA_USED = Gauge("shmserve_frontend_arena_used_bytes",
                   "Bytes of a frontend's shared memory (shm.arena_mb) held by requests in "
                   "flight, read every second", ["frontend"], multiprocess_mode="livesum")
TEXTS = Counter("shmserve_texts_total", "Inputs run through a model (texts; a rerank's "
                "documents, each one query-document pair)", ["model"])
TOKENS = Counter("shmserve_tokens_total", "Tokens run through a model (after truncation; a "
                 "rerank's query counted in each pair)", ["model"])
INPUT_TOKENS = Histogram("shmserve_input_tokens", "Tokens per input text (after truncation)",
                         ["model"], buckets=shared.TOKEN_BUCKETS)
TRUNCATED = Counter("shmserve_truncated_texts_total", "Texts cut to the model's limit", ["model"])
REJECTED = Counter("shmserve_rejected_requests_total",
                   "Requests refused for overload (429): frontend in-flight limit, worker queue, "
                   "or a worker's admission by deadline (shmserve_worker_refused_total: which)",
                   ["model"])
REFUSED = Counter("shmserve_frontend_refused_total",
                  "Requests a frontend refused itself (429): inflight (frontends.max_inflight), "
                  "arena (shm.arena_mb taken; shm_full: /dev/shm itself full, a 503) or "
                  "deadline (every worker's heartbeat says its "
                  "queue would not let the request finish in time: workers.refuse_past_deadline)",
                  ["reason"])
RETRIES = Counter("shmserve_frontend_retries_total",
                  "Requests sent again to a worker (frontends.retry_on_worker_loss): its worker "
                  "was lost with the request in it (worker_lost; the work it did is redone), "
                  "answered that it was loading or draining (unavailable; it did nothing), or "
                  "refused it for its load while another was ready (overloaded; once)",
                  ["reason"])
SUSPECTS = Counter("shmserve_frontend_suspect_requests_total",
                   "Requests in the pass that was running when their worker was lost, which may "
                   "be what killed it: sent again to run alone (isolated), or lost again running "
                   "alone and answered 500 (failed: their inputs likely crash the model; never "
                   "sent again)", ["outcome"])
SPREAD = Counter("shmserve_frontend_spread_requests_total",
                 "Large requests cut into parts run at once on idle workers "
                 "(frontends.spread_part_texts): spread, or mixed_revisions (a reload committed "
                 "between its parts: run again whole on one worker); and those large enough "
                 "that ran whole: whole_for_queries (a smaller request came within "
                 "frontends.spread_quiet_s), whole_for_busy_workers (fewer than two of its "
                 "model's workers idle)", ["outcome"])
DEADLINES = Counter("shmserve_deadline_exceeded_total",
                    "Requests whose deadline passed (504)", ["model"])
WORKER_RESTARTS = Counter("shmserve_worker_restarts_seen_total",
                          "Worker restarts a frontend noticed (a heartbeat with a new pid); "
                          "every frontend counts each restart: use max by (worker)",
                          ["frontend", "worker"])
WORKER_HUNG_KILLS = Counter("shmserve_worker_hung_kills_total",
                            "Workers a frontend SIGKILLed after workers.hung_kill_s of silence "
                            "(frontend.watchdog); several frontends may count one: use max by "
                            "(worker)", ["frontend", "worker"])

RELOADS = Counter("shmserve_reloads_total",
                  "Hot reloads asked through the admin API, by model unit (MODEL, or "
                  "MODEL@VARIANT for an A/B arm) and outcome: ok, or the error's kind "
                  "(invalid_request: the new weights do not load or fit; conflict: another "
                  "reload of it ran; unavailable; internal_error)", ["model", "outcome"])
RELOAD_SECONDS = Histogram("shmserve_reload_duration_seconds",
                           "A successful hot reload, from the admin call to every worker "
                           "switched (loading and warming the new weights included)",
                           ["model"], buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600))

# Inference requests by A/B arm and priority (the routes that run a model): an A/B test
# compares its arms' latency and errors, and priorities are there to keep the interactive
# ones fast (an outside check found neither in the metrics).
INFERENCE = Counter("shmserve_inference_requests_total",
                    "Inference requests answered, by model, A/B variant (\"\" without a "
                    "split), priority (-10..10: low -1, normal 0, high 1) and status",
                    ["model", "variant", "priority", "status"])
INFERENCE_LATENCY = Histogram("shmserve_inference_request_duration_seconds",
                              "Time from the frontend receiving an inference request to its "
                              "response, by model, A/B variant, priority and status",
                              ["model", "variant", "priority", "status"],
                              buckets=shared.LATENCY_BUCKETS)

CACHE = Counter("shmserve_response_cache_requests_total",
                "Inference requests the frontends' response cache looked up "
                "(frontends.response_cache_mb), by result: hit (every input's row there: no "
                "worker ran it) or miss (run, its rows kept)", ["model", "result"])
CACHE_BYTES = Gauge("shmserve_response_cache_bytes", "Bytes a frontend's response cache holds",
                    ["frontend"], multiprocess_mode="livesum")

# Triton's statistics extension (GET /v2/models/stats: frontend.stats), by model and revision
# (the version a KServe client names); hidden from /metrics (shmserve.metrics.HIDDEN_PREFIX),
# which has the same facts as the histograms above. outcome: success (the request ran and was
# answered), fail (as observe_inference counts failures: 429, 499, 504, 5xx), cache_hit and
# cache_miss (frontends.response_cache_mb); part: those outcomes (their whole time; the cache's:
# its lookup, and a miss's keeping of the rows), queue, compute_input (tokenizing),
# compute_infer (the worker's forwards), compute_output (the reply to the response rendered),
# each for the successes a worker ran.
STATS_REQUESTS = Counter("shmserve_stats_requests_total", "Inference requests by outcome",
                         ["model", "revision", "outcome"])
STATS_SECONDS = Counter("shmserve_stats_seconds_total", "Inference requests' time by part",
                        ["model", "revision", "part"])
STATS_INFERENCES = Counter("shmserve_stats_inferences_total", "Inputs of successful requests",
                           ["model", "revision"])
STATS_LAST = Gauge("shmserve_stats_last_inference_ms", "The last inference request's end, ms "
                   "since the epoch", ["model", "revision"], multiprocess_mode="max")
STATS_PARTS = {"queue": "queue", "tokenize": "compute_input", "inference": "compute_infer",
               "transfer": "compute_output"}  # stage -> its part

TRACE_SPANS = Counter("shmserve_trace_spans_total",
                      "Spans the frontends' tracing handed on (tracing.otlp_endpoint), by "
                      "result: exported (the collector took them), failed (its batch failed "
                      "after the exporter's retries), dropped (the queue was full, or still "
                      "held them when a stopping frontend's 2 s were up)", ["result"])

# The request path's children, cached (shmserve.metrics.Children): call as `texts(model)`.
# Their updates are written once per event-loop turn (shmserve.metrics.Turn): a frontend answers
# a worker's whole batch of replies in one turn.
turn = Turn()
requests, latency, stage = (Children(m, turn) for m in (REQUESTS, LATENCY, STAGE))
inference, inference_latency = Children(INFERENCE, turn), Children(INFERENCE_LATENCY, turn)
inflight, texts, tokens = (Children(m, turn) for m in (INFLIGHT, TEXTS, TOKENS))
input_tokens, truncated = Children(INPUT_TOKENS, turn), Children(TRUNCATED, turn)
rejected, deadlines = Children(REJECTED, turn), Children(DEADLINES, turn)
refused, retries = Children(REFUSED, turn), Children(RETRIES, turn)
suspects, spread = Children(SUSPECTS, turn), Children(SPREAD, turn)
cache, cache_bytes = Children(CACHE, turn), Children(CACHE_BYTES)


RELOAD_OUTCOMES = ("ok", "invalid_request", "conflict", "unavailable", "internal_error")


def start(models: dict[str, Any], frontend: int, workers: int) -> None:
    """Create this frontend's series at zero, so they are exposed (and rate() works) before
    their first event. `models`: name -> frontend.app.ServedModel (a hot reload names its
    variants' units, MODEL@VARIANT)."""
    for unit in (v.unit for served in models.values() for v in served.variants):
        for outcome in RELOAD_OUTCOMES:
            RELOADS.labels(unit, outcome)
    for model in models:
        for metric in (TEXTS, TOKENS, TRUNCATED, REJECTED, DEADLINES, INPUT_TOKENS):
            metric.labels(model)
        for stage in STAGES:
            STAGE.labels(stage, model)
    for worker in range(workers):
        WORKER_RESTARTS.labels(str(frontend), str(worker))
        WORKER_HUNG_KILLS.labels(str(frontend), str(worker))
    for reason in ("inflight", "deadline", "arena", "shm_full"):
        REFUSED.labels(reason)
    for reason in ("worker_lost", "unavailable", "overloaded"):
        RETRIES.labels(reason)
    for outcome in ("isolated", "failed"):
        SUSPECTS.labels(outcome)
    for outcome in ("spread", "mixed_revisions", "whole_for_queries", "whole_for_busy_workers"):
        SPREAD.labels(outcome)
    INFLIGHT.labels(str(frontend)).set(0)
    ARENA_USED.labels(str(frontend)).set(0)


def observe_request(route: str, model: str, status: int, seconds: float,
                    revision: str = "") -> None:
    """The per-request counters every route gets (the middleware calls this)."""
    code = str(status)
    requests(route, model, code, revision).inc()
    latency(route, model, code).observe(seconds)
    if status == 429:
        rejected(model).inc()
    elif status == 504:
        deadlines(model).inc()


def failed(status: int) -> bool:
    """An inference request's status that is the server's failure, not the request's own
    refusal: 429, 499, 504, 5xx (an A/B arm's error ratio; Triton's statistics' `fail`)."""
    return status >= 500 or status in (429, 499)


def observe_inference(model: str, variant: str, priority: int, status: int,
                      seconds: float) -> None:
    """An inference request's counters by A/B arm and priority (the middleware calls this for
    the requests that chose them). A refusal of the request itself found after its arm was
    chosen (400, 413, 422: token ids outside the vocabulary, `dimensions` past the model's
    width, an unknown prompt) is not counted: an arm's error ratio is the server's (429, 499,
    504, 5xx; docs/observability.md), and an outside check found them counted."""
    if 400 <= status < 500 and not failed(status):
        return
    labels = (model, variant, str(priority), str(status))
    inference(*labels).inc()
    inference_latency(*labels).observe(seconds)


stats_requests, stats_seconds = Children(STATS_REQUESTS), Children(STATS_SECONDS)
stats_inferences, stats_last = Children(STATS_INFERENCES), Children(STATS_LAST)


class StatsTally:
    """Triton's statistics (STATS_*) of a turn's inference requests, summed per model and
    revision and written once the turn ends (`turn`): a request adds to one row, not to eight
    children (20,000 requests in a loop, 32 a turn: 9.7 us a request through `Children`, 3.6 us
    here, as much as `observe_request`)."""

    # A row: per outcome (success, fail, cache_hit, cache_miss) its requests then its seconds,
    # then each STATS_PARTS stage's seconds, the inputs, and the latest end (ms).
    _OUTCOMES = ("success", "fail", "cache_hit", "cache_miss")
    _PARTS = tuple(STATS_PARTS)
    _FIRST_PART = 2 * len(_OUTCOMES)
    _INPUTS = _FIRST_PART + len(_PARTS)
    # each of a row's numbers' series: (children, labels after model and revision)
    _SERIES = (*((c, outcome) for outcome in _OUTCOMES for c in (stats_requests, stats_seconds)),
               *((stats_seconds, STATS_PARTS[stage]) for stage in _PARTS), (stats_inferences,))

    def __init__(self, turn: Turn) -> None:
        self._turn = turn
        self._rows: dict[tuple[str, str], list[float]] = {}
        self._last: dict[tuple[str, str], float] = {}  # STATS_LAST as this process set it

    def add(self, model: str, revision: str, seconds: float, stages: dict[str, float] | None,
            inputs: int, now_ms: int, cache: tuple | None = None) -> None:
        """A success with its `stages` (frontend.app.STAGES) and `inputs`, or a failure
        (`stages` None); `cache`: the response cache's (hit or miss, seconds), if it looked.
        A success answered from the cache counts as a success and a cache hit, and in no stage
        and no input (as Triton counts them)."""
        row = self._rows.get((model, revision))
        new = row is None
        if new:
            row = self._rows[(model, revision)] = [0.0] * (self._INPUTS + 2)
        if stages is None:
            row[2] += 1
            row[3] += seconds
        else:
            row[0] += 1
            row[1] += seconds
            if cache is not None:
                at = 4 if cache[0] == "hit" else 6
                row[at] += 1
                row[at + 1] += cache[1]
            if cache is None or cache[0] != "hit":
                for i, stage in enumerate(self._PARTS):
                    row[self._FIRST_PART + i] += stages.get(stage, 0.0)
                row[self._INPUTS] += inputs
        row[-1] = max(row[-1], now_ms)
        if new:  # written as the turn ends (outside an event loop: at once)
            self._turn.defer(self.write)

    def write(self) -> None:
        """The turn's rows into the metric files, the latest end first and each outcome's
        count last: another frontend reads them while they are written, and one that sees a
        count grow (Stack.settled waits on it) sees that request's seconds, stages and end
        too (a CI run read a failure counted with the end before it)."""
        rows, self._rows = self._rows, {}
        for (model, revision), row in rows.items():
            if row[-1] > self._last.get((model, revision), 0.0):  # (a clock set back)
                self._last[(model, revision)] = row[-1]
                stats_last(model, revision).set(row[-1])
            for (children, *label), amount in reversed(tuple(zip(self._SERIES, row))):
                if amount:  # (a series only once it counts something: no cache, no cache_hit)
                    children(model, revision, *label).inc(amount)


stats = StatsTally(turn)


def exposition(cfg: Config, workers: int, lost: Iterable[int] = ()) -> tuple[bytes, str]:
    """The whole deployment's metrics; blocking (files, supervisord's socket): run it off the
    event loop. `workers`: how many the deployment has (each shows shmserve_worker_ready,
    0 while it does not run, and while this frontend has `lost` it: silent, hung)."""
    return shared.exposition([shared.ResidentMemory(lambda: processes.resident(cfg)),
                              shared.OpenFiles(lambda: processes.open_files(cfg)),
                              shared.Filesystems({"run_dir": str(cfg.run_dir),
                                                  "shm": str(SHM_DIR)})],
                             [str(i) for i in range(workers)], [str(i) for i in lost])
