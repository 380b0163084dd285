"""Request traces: one OpenTelemetry span per request, with a child span per stage, exported over
OTLP/HTTP to `tracing.otlp_endpoint` (any OpenTelemetry collector, Jaeger, Tempo, ...). Off when
no endpoint is set, and then nothing here is imported.

A request joins its caller's trace when it carries W3C Trace Context (`traceparent`), else it
starts one; sampling follows the caller's decision, else `tracing.sample_ratio`. The stage spans
(tokenize, handoff, queue, inference, transfer) are laid out from the timings the frontend
already keeps (the worker reports its queue and forward time with its reply), not measured
twice: tokenize from its start, inference ending when the reply arrived, queue just before it,
handoff from the tokens ready to the queue's start (both trips between the processes: the way
back shown on the way there), transfer from the reply to the response. A sampled request's
access line carries its `trace_id`, and so does one that its caller's `traceparent` flagged not
sampled (the caller's id).

Spans leave through the SDK's batch processor, on its own thread: the request path only records.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from typing import Mapping

from frontend import metrics
from shmserve.config import Config

log = logging.getLogger("shmserve.frontend")
CLOSE_S = 2.0  # what a stopping frontend gives the collector (its stop wait: drain + 5 s)


class HideEndpointSecrets(logging.Filter):
    """Replace the user information and the query string of `url` with *** in the records of
    the exporter and the HTTP library under it (the others, a line per request among them, are
    passed as they are, unread)."""

    LOGGERS = ("opentelemetry", "urllib3", "requests")

    def __init__(self, url: str) -> None:
        super().__init__()
        parts = urllib.parse.urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        found = {parts.query, userinfo, parts.password or ""}
        self.secrets = sorted((s for s in found if s), key=len, reverse=True)

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets or not record.name.startswith(self.LOGGERS):
            return True
        message = record.getMessage()
        if (hidden := self._hide(message)) != message:
            record.msg, record.args = hidden, None
        if record.exc_info and record.exc_info[1] is not None:
            text = record.exc_text or logging.Formatter().formatException(record.exc_info)
            if (shown := self._hide(text)) != text:
                record.exc_text = shown
        return True

    def _hide(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text


class Tracing:
    def __init__(self, cfg: Config, index: int) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import (SpanKind, Status, StatusCode, get_current_span,
                                         set_span_in_context)
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        t = cfg.tracing
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": t.service_name,
                                      "service.instance.id": f"frontend-{index}"}),
            sampler=ParentBased(TraceIdRatioBased(t.sample_ratio)))
        self.processor = _counted(OTLPSpanExporter(endpoint=t.otlp_endpoint, timeout=5))
        # The exporter's own warnings quote the URL it failed ("... url: /v1/traces?token=..."):
        # keep the endpoint's secrets (user:password, query) out of every log line, as
        # `shmserve config` keeps them out of its output.
        hide = HideEndpointSecrets(t.otlp_endpoint)
        for handler in logging.getLogger().handlers:
            handler.addFilter(hide)
        self.provider.add_span_processor(self.processor)
        for result in ("exported", "failed", "dropped"):
            metrics.TRACE_SPANS.labels(result)
        self.tracer = self.provider.get_tracer("shmserve.frontend")
        self.propagator = TraceContextTextMapPropagator()
        self._server, self._in_context = SpanKind.SERVER, set_span_in_context
        self._span_of = get_current_span
        self._error = Status(StatusCode.ERROR)

    def record(self, headers: Mapping[str, str], name: str, started: float, ended: float,
               attributes: dict, stages: dict[str, float] | None = None,
               tokenize_at: float | None = None, replied_at: float | None = None,
               error: bool = False) -> str | None:
        """A finished request's spans (times: time.perf_counter()); its trace id (hex): the
        sampled span's, or where it was not sampled the caller's (a `traceparent` flagged not
        sampled: the caller's own logs may carry it), else None."""
        offset = time.time_ns() - time.perf_counter_ns()

        def ns(t: float) -> int:
            return int(t * 1e9) + offset

        caller = self.propagator.extract(headers)
        span = self.tracer.start_span(name, context=caller, kind=self._server,
                                      start_time=ns(started), attributes=attributes)
        if not span.is_recording():
            parent = self._span_of(caller).get_span_context()
            return format(parent.trace_id, "032x") if parent.is_valid else None
        if stages and replied_at is not None:
            inner = self._in_context(span)
            inference_at = replied_at - stages["inference"]
            tokenized_at = None if tokenize_at is None else tokenize_at + stages["tokenize"]
            # no handoff for a request sent again after its worker was lost
            handoff_at = tokenized_at if "handoff" in stages else None
            for stage, start, end in (
                    ("tokenize", tokenize_at, tokenized_at),
                    ("handoff", handoff_at,
                     None if handoff_at is None else handoff_at + stages["handoff"]),
                    ("queue", inference_at - stages["queue"], inference_at),
                    ("inference", inference_at, replied_at),
                    ("transfer", replied_at, ended)):
                if start is not None:
                    self.tracer.start_span(stage, context=inner, start_time=ns(start)).end(
                        end_time=ns(end))
        if error:
            span.set_status(self._error)
        span.end(end_time=ns(ended))
        return format(span.get_span_context().trace_id, "032x")

    def close(self, timeout_s: float = CLOSE_S) -> None:
        """Send what is buffered for at most `timeout_s`, then stop: the SDK's own shutdown
        waits up to 30 s and then exports its whole queue, 5 s a batch, and a collector that
        accepts and never answers held stopping frontends past supervisord's stop wait
        (SIGKILLed, their last log lines lost: an outside check). What is left is dropped."""
        closing = threading.Thread(target=self.provider.shutdown, name="trace-close",
                                   daemon=True)
        closing.start()
        closing.join(timeout_s)
        if closing.is_alive():
            left = self.processor.queued()
            metrics.TRACE_SPANS.labels("dropped").inc(left)
            log.warning("tracing.close_cut", extra={"fields": {"after_s": timeout_s,
                                                               "spans_dropped": left}})


def _counted(exporter):
    """The SDK's batch processor over `exporter`, counting what becomes of each span in
    shmserve_trace_spans_total: the SDK reports its drops only in its own log (at most once in
    20 s) and an OpenTelemetry meter, which nothing here reads."""
    from opentelemetry.sdk.trace.export import (BatchSpanProcessor, SpanExporter,
                                                SpanExportResult)

    spans = metrics.TRACE_SPANS

    class Counted(SpanExporter):
        def export(self, batch):
            try:
                result = exporter.export(batch)
            except Exception:
                spans.labels("failed").inc(len(batch))
                raise  # the SDK logs it
            ok = result is SpanExportResult.SUCCESS
            spans.labels("exported" if ok else "failed").inc(len(batch))
            return result

        def shutdown(self) -> None:
            exporter.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return exporter.force_flush(timeout_millis)

    class Processor(BatchSpanProcessor):
        def on_end(self, span) -> None:
            if self.queued() >= getattr(self._batch_processor, "_max_queue_size", 1 << 62):
                spans.labels("dropped").inc()  # the SDK's queue drops its oldest to take it
            super().on_end(span)

        def queued(self) -> int:
            """Spans waiting for export (the SDK's queue: a pinned version's internals)."""
            return len(getattr(self._batch_processor, "_queue", ()))

    return Processor(Counted())
