"""Triton's statistics extension: per model and version, what every frontend and worker of the
deployment counted since `shmserve up`, in the form of Triton's `GET /v2/models/stats` (its
ModelStatistics over gRPC), which tritonclient's get_inference_statistics() reads.

    inference_count    inputs of successful requests (texts; a rerank's documents)
    execution_count    the workers' passes (a pass is one batch: its texts may run in a few
                       forwards of similar lengths)
    inference_stats    success and fail: requests and their whole time in the frontend (fail
                       as shmserve_inference_requests_total counts failures: 429, 499, 504,
                       5xx); for successes, queue (the worker's queue), compute_input
                       (tokenizing), compute_infer (the forwards its texts ran in) and
                       compute_output (the worker's reply to the response rendered). The rest
                       of a request's time (ZeroMQ both ways, the event loops' waits) is in
                       none of them: perf_analyzer shows it as overhead. cache_hit and
                       cache_miss: the response cache's (frontends.response_cache_mb; zero
                       without one): a hit is a success too, and in no other part nor input.
    batch_stats        per batch size (texts in a pass): passes and their forwards' time
                       (compute_infer; copies to and from the device included)

Versions are revisions (frontend.kserve): the stats of a model name each version it serves now,
each with what was counted under that revision (an A/B arm's, or the weights a reload replaced
it with from then on). Every number is read at request time from the processes' metric files
(shmserve.metrics.hidden_samples), so any frontend nginx picks answers the same; they survive
restarts of a process, as Prometheus's counters do, and start again at `shmserve up`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from prometheus_client.samples import Sample

from frontend.metrics import STATS_PARTS

NS = 1e9


def model_stats(samples: Iterable[Sample], versions: dict[str, list[str]],
                units: dict[str, str]) -> list[dict]:
    """Triton's $model_stat objects for `versions` (model name -> the versions to report, in
    order) from the hidden metric `samples`; `units` maps a worker's unit (MODEL@VARIANT) to
    its model's name."""
    requests: dict[tuple, float] = defaultdict(float)  # (model, revision, outcome)
    seconds: dict[tuple, float] = defaultdict(float)  # (model, revision, part)
    inferences: dict[tuple, float] = defaultdict(float)
    last: dict[tuple, float] = defaultdict(float)
    batches: dict[tuple, dict[int, list[float]]] = defaultdict(
        lambda: defaultdict(lambda: [0.0, 0.0]))  # (model, revision) -> size -> [count, s]
    for sample in samples:
        labels = sample.labels
        model = units.get(labels.get("model", ""), labels.get("model", ""))
        key = (model, labels.get("revision", ""))
        name = sample.name
        if name == "shmserve_stats_requests_total":
            requests[(*key, labels["outcome"])] += sample.value
        elif name == "shmserve_stats_seconds_total":
            seconds[(*key, labels["part"])] += sample.value
        elif name == "shmserve_stats_inferences_total":
            inferences[key] += sample.value
        elif name == "shmserve_stats_last_inference_ms":
            last[key] = max(last[key], sample.value)
        elif name == "shmserve_stats_executions_total":
            batches[key][int(labels["batch_size"])][0] += sample.value
        elif name == "shmserve_stats_execution_seconds_total":
            batches[key][int(labels["batch_size"])][1] += sample.value
    out = []
    for model, revisions in versions.items():
        for revision in revisions:
            key = (model, revision)
            successes = int(requests[(*key, "success")])

            def duration(part: str, count: int) -> dict:
                return {"count": count, "ns": int(round(seconds[(*key, part)] * NS))}

            by_size = sorted(batches[key].items()) if key in batches else []
            out.append({
                "name": model, "version": revision, "last_inference": int(last[key]),
                "inference_count": int(inferences[key]),
                "execution_count": int(sum(count for _, (count, _) in by_size)),
                "inference_stats": {
                    "success": duration("success", successes),
                    "fail": duration("fail", int(requests[(*key, "fail")])),
                    # (a success the response cache answered ran in none of them)
                    **{part: duration(part, successes - int(requests[(*key, "cache_hit")]))
                       for part in STATS_PARTS.values()},
                    **{part: duration(part, int(requests[(*key, part)]))
                       for part in ("cache_hit", "cache_miss")}},
                "batch_stats": [
                    {"batch_size": size, "compute_infer": {
                        "count": int(count), "ns": int(round(spent * NS))}}
                    for size, (count, spent) in by_size if count]})
    return out
