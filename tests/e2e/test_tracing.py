"""Request traces over OTLP/HTTP (tracing.otlp_endpoint), through nginx, to a collector this test
runs: what a user's OpenTelemetry collector, Jaeger or Tempo would receive."""

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.conftest import tiny_overrides
from tests.stack import Stack

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Collector:
    """An OTLP/HTTP receiver on loopback: keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list = []  # (resource attributes, span)
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource_spans in request.resource_spans:
                    resource = {a.key: a.value.string_value
                                for a in resource_spans.resource.attributes}
                    for scope in resource_spans.scope_spans:
                        collector.spans.extend((resource, s) for s in scope.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, predicate, timeout: float = 20.0) -> list:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for r, s in self.spans if predicate(r, s)]
            if found:
                return found
            time.sleep(0.1)
        raise AssertionError(f"no such span among {len(self.spans)}")


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.server.shutdown()
    c.server.server_close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model, collector):
    s = Stack(tmp_path_factory.mktemp("tracing"), tiny_overrides(
        tiny_model, tracing={"otlp_endpoint": collector.url, "service_name": "emb-test"}))
    s.env["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # the SDK's own knob (ms; 5,000 by default)
    s.up()
    yield s
    s.down()


def attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = v.string_value if v.HasField("string_value") else v.int_value
    return out


def test_a_request_joins_its_callers_trace_with_a_span_per_stage(stack, collector):
    status, headers, body = stack.post_json(
        "/v1/embeddings", {"input": ["hello", "world"], "model": "tiny"},
        {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert status == 200
    request_id = headers["X-Request-ID"]
    (root,) = collector.wait_for(lambda r, s: s.trace_id.hex() == TRACE_ID
                                 and s.parent_span_id.hex() == PARENT_ID)
    assert root.name == "POST /v1/embeddings"
    a = attrs(root)
    assert a["shmserve.request_id"] == request_id and a["shmserve.model"] == "tiny"
    assert a["http.response.status_code"] == 200
    resource = next(r for r, s in collector.spans if s is root)
    assert resource["service.name"] == "emb-test"
    assert resource["service.instance.id"].startswith("frontend-")
    children = collector.wait_for(lambda r, s: s.parent_span_id == root.span_id)
    by_name = {s.name: s for s in children}
    assert set(by_name) == {"tokenize", "handoff", "queue", "inference", "transfer"}
    for child in children:
        assert child.trace_id == root.trace_id
        assert root.start_time_unix_nano <= child.start_time_unix_nano
        assert child.start_time_unix_nano <= child.end_time_unix_nano
        assert child.end_time_unix_nano <= root.end_time_unix_nano + 1_000_000  # 1 ms rounding
    # Laid out in order: tokens, both trips between the processes (handoff, shown before the
    # worker's part), the worker's queue and forward, then the reply's way back.
    assert by_name["tokenize"].end_time_unix_nano <= by_name["handoff"].start_time_unix_nano + 1
    assert by_name["handoff"].end_time_unix_nano <= by_name["queue"].start_time_unix_nano + 1_000
    assert by_name["queue"].end_time_unix_nano <= by_name["inference"].start_time_unix_nano + 1
    assert by_name["inference"].end_time_unix_nano <= by_name["transfer"].start_time_unix_nano + 1
    inference_ms = float(headers["X-Inference-Time"])
    got_ms = (by_name["inference"].end_time_unix_nano
              - by_name["inference"].start_time_unix_nano) / 1e6
    assert got_ms == pytest.approx(inference_ms, abs=0.01)
    # The access line names the trace.
    stack.wait_until(lambda: any(line.get("request_id") == request_id and "trace_id" in line
                                 for name in ("frontend-0", "frontend-1")
                                 for line in stack.log_lines(name)), 10, "the access line")
    line = next(line for name in ("frontend-0", "frontend-1") for line in stack.log_lines(name)
                if line.get("request_id") == request_id and "trace_id" in line)
    assert line["trace_id"] == TRACE_ID


def test_without_a_caller_a_request_starts_its_own_trace(stack, collector):
    with openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0) as client:
        raw = client.embeddings.with_raw_response.create(model="tiny", input=["fresh"])
    request_id = raw.headers["x-request-id"]
    (root,) = collector.wait_for(lambda r, s: attrs(s).get("shmserve.request_id") == request_id)
    assert not root.parent_span_id and root.trace_id.hex() != TRACE_ID


def test_errors_are_traced_as_errors_and_probes_not_at_all(stack, collector):
    status, headers, _ = stack.post_json("/v1/embeddings", {"input": ["x"], "model": "nope"})
    assert status == 404
    (root,) = collector.wait_for(
        lambda r, s: attrs(s).get("shmserve.request_id") == headers["X-Request-ID"])
    assert attrs(root)["http.response.status_code"] == 404
    # Its children would have been sent with it: an error has no stages.
    assert not [s for r, s in collector.spans if s.parent_span_id == root.span_id]
    before = len(collector.spans)
    for path in ("/health", "/ready", "/metrics"):
        assert stack.get(path)[0] == 200
    # Spans leave in the order they ended: once a later request's has arrived, a probe's
    # would have too.
    status, headers, _ = stack.post_json("/v1/embeddings", {"input": ["after the probes"]})
    collector.wait_for(lambda r, s: attrs(s).get("shmserve.request_id") == headers["X-Request-ID"])
    names = [s.name for r, s in collector.spans[before:]]
    assert names and not [n for n in names if n.endswith(("/health", "/ready", "/metrics"))]


def test_a_caller_that_did_not_sample_gets_no_spans_and_its_trace_id_logged(stack, collector):
    """traceparent flagged -00: the caller chose not to sample; nothing is exported, and the
    access line still names the caller's trace, so its logs and ours join (an outside check)."""
    unsampled = "0af7651916cd43dd8448eb211c80319d"
    status, headers, _ = stack.post_json("/v1/embeddings", {"input": ["not sampled"]},
                                         {"traceparent": f"00-{unsampled}-{PARENT_ID}-00"})
    assert status == 200
    request_id = headers["X-Request-ID"]

    def access() -> list[dict]:
        return [line for name in ("frontend-0", "frontend-1") for line in stack.log_lines(name)
                if line.get("request_id") == request_id and line.get("message") == "request"]
    stack.wait_until(access, 10, "the access line")
    assert [line.get("trace_id") for line in access()] == [unsampled]
    # A later request's span has arrived: the unsampled one's would have come before it.
    status, headers, _ = stack.post_json("/v1/embeddings", {"input": ["after"]})
    collector.wait_for(lambda r, s: attrs(s).get("shmserve.request_id") == headers["X-Request-ID"])
    assert not [s for r, s in collector.spans if s.trace_id.hex() == unsampled
                or attrs(s).get("shmserve.request_id") == request_id]


def test_a_malformed_traceparent_starts_a_new_trace(stack, collector):
    status, headers, _ = stack.post_json(
        "/v1/embeddings", {"input": ["x"]},
        {"traceparent": "00-not-a-trace-id-01", "tracestate": "=" * 300})
    assert status == 200
    (root,) = collector.wait_for(
        lambda r, s: attrs(s).get("shmserve.request_id") == headers["X-Request-ID"])
    assert not root.parent_span_id


def spans_counted(stack) -> dict[str, float]:
    """shmserve_trace_spans_total by result, over every frontend (exited ones too)."""
    from tests.e2e.test_observability import scrape, total

    samples = scrape(stack)
    return {result: total(samples, "shmserve_trace_spans_total", result=result)
            for result in ("exported", "failed", "dropped")}


def test_every_span_the_collector_took_is_counted_exported(stack, collector):
    """What became of spans was in no metric (an outside check): a collector's outage or a full
    queue was seen only in a frontend's log."""
    before = spans_counted(stack)["exported"]
    for _ in range(20):
        assert stack.post_json("/v1/embeddings", {"input": ["count me"]})[0] == 200

    def settled() -> bool:  # each request's 5 spans exported (the SDK exports in batches:
        # exported equalled what the collector held after the first of them, 31 of 100)
        exported = spans_counted(stack)["exported"]
        return exported - before >= 100 and exported == len(collector.spans)

    stack.wait_until(settled, 20, "the exported spans counted")
    counted = spans_counted(stack)
    assert counted["failed"] == counted["dropped"] == 0


def test_a_collector_that_never_answers_does_not_hold_a_stopping_frontend(stack):
    """The SDK's shutdown exported its whole queue, 5 s a batch, to a collector that accepts
    and never answers: stopping frontends outlived supervisord's stop wait and were SIGKILLed,
    their last log lines lost (an outside check: a restart of two frontends took 24 s). Now a
    frontend gives the collector 2 s (tracing.CLOSE_S). Last in the module: it moves the
    stack's endpoint."""
    import json
    import socket
    from concurrent.futures import ThreadPoolExecutor

    import yaml

    silent = socket.create_server(("127.0.0.1", 0), backlog=512)  # listens, never accepts
    try:
        tree = yaml.safe_load(stack.config_file.read_text())
        tree["tracing"]["otlp_endpoint"] = \
            f"http://127.0.0.1:{silent.getsockname()[1]}/v1/traces"
        stack.config_file.write_text(yaml.safe_dump(tree))
        assert "shmserve: applied" in stack.cli("apply", timeout=300).stdout
        body = json.dumps({"texts": ["trace me"]}).encode()
        with ThreadPoolExecutor(8) as pool:  # ~5 spans each: past the SDK's 2,048-span queue
            statuses = list(pool.map(lambda _: stack.request(
                "POST", "/predict", body, {"Content-Type": "application/json"})[0],
                range(600)))
        assert set(statuses) == {200}
        # ~1,500 spans a frontend whose batches never leave: each batch fails after the
        # exporter's 5 s, and at the stop what is still queued is dropped; all counted but
        # a batch in flight a frontend
        stack.wait_until(lambda: spans_counted(stack)["failed"] > 0, 30, "failures counted")
        done = stack.cli("restart", "frontends", timeout=300)
        assert done.returncode == 0, done.stderr
        # The old shutdown outlived the stop wait (drain + 5 s = 10 s here): SIGKILLed, its
        # last lines lost. Not timed as a whole: a rolling restart's starts took 27 s in a
        # loaded CI run, which says nothing about the stops.
        killed = [line for line in (stack.run_dir / "logs" / "supervisord.log").read_text()
                  .splitlines() if "SIGKILL" in line and "frontend" in line]
        assert not killed, killed
        for program in ("frontend-0", "frontend-1"):
            said = [line.get("message") for line in stack.log_lines(program)]
            cut = said.index("tracing.close_cut")  # cut at CLOSE_S, then it exited itself
            assert "frontend.stopped" in said[cut:], (program, said[cut:])
        counted = spans_counted(stack)  # the queue's rest dropped at the cut
        assert counted["dropped"] + counted["failed"] >= 600 * 5 - 2 * 512, counted
    finally:
        silent.close()
