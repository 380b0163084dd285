"""Prometheus metrics of a frontend process, aggregated over all processes at scrape time.

supervisord sets PROMETHEUS_MULTIPROC_DIR for every program (``shmserve up`` empties it), so
prometheus_client writes each process's values to files there and `/metrics` sums them.
"""

from __future__ import annotations

import os

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)
from prometheus_client import multiprocess

# Millisecond-scale latencies, in seconds as Prometheus prefers.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                   0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)

REQUESTS = Counter("shmserve_requests_total", "HTTP requests answered by the frontends",
                   ["route", "model", "status", "revision"])  # revision: of the weights that
                                                             # served it ("" without inference)
LATENCY = Histogram("shmserve_request_duration_seconds",
                    "Time from the frontend receiving a request to its response",
                    ["route", "model"], buckets=LATENCY_BUCKETS)
INFLIGHT = Gauge("shmserve_frontend_inflight_requests", "Requests being served per frontend",
                 ["frontend"], multiprocess_mode="livesum")
TEXTS = Counter("shmserve_texts_total", "Texts embedded", ["model"])
TOKENS = Counter("shmserve_tokens_total", "Tokens embedded (after truncation)", ["model"])
TRUNCATED = Counter("shmserve_truncated_texts_total", "Texts cut to the model's limit", ["model"])


def exposition() -> tuple[bytes, str]:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    else:  # a frontend run by hand, outside supervisord
        from prometheus_client import REGISTRY as registry
    return generate_latest(registry), CONTENT_TYPE_LATEST
