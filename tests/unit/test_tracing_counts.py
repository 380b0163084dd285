"""What becomes of each span is counted (shmserve_trace_spans_total): a full queue's drops and a
stopping frontend's cut were only in its log, at most once in 20 s (an outside check)."""

import socket
import time

from frontend import metrics
from frontend.tracing import Tracing
from shmserve import config


def counted(result: str) -> float:
    return metrics.TRACE_SPANS.labels(result)._value.get()


def test_a_full_queue_and_a_cut_close_count_their_spans_dropped(monkeypatch):
    silent = socket.create_server(("127.0.0.1", 0))  # listens, never accepts
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "10")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "5")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")  # nothing leaves on its own
    cfg = config.load(environ={"SHMSERVE__TRACING__OTLP_ENDPOINT":
                               f"http://127.0.0.1:{silent.getsockname()[1]}/v1/traces"})
    tracing = Tracing(cfg, 0)
    before = {r: counted(r) for r in ("exported", "failed", "dropped")}
    try:
        now = time.perf_counter()
        for _ in range(30):  # a root span each; the queue holds 10
            assert tracing.record({}, "POST /embed", now, now + 0.001, {}) is not None
        # the batches of 5 the queue woke its thread for hang on the silent collector; what
        # the queue could not hold was dropped, oldest first
        dropped = counted("dropped") - before["dropped"]
        assert 30 - 10 - 5 <= dropped <= 30 - 10, dropped
        tracing.close(timeout_s=0.5)  # the rest is cut
        total = sum(counted(r) - before[r] for r in before)
        assert 30 - 5 <= total <= 30, total  # all but a batch in flight, which nobody knows
        assert counted("exported") == before["exported"]
    finally:
        silent.close()
