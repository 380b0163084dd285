"""The OTLP exporter's own warnings quote the URL it failed to reach: the endpoint's user:password
and query string (a collector's ?token=) stay out of the logs, as `shmserve config` hides them
(an outside check found the token in the frontends' logs)."""

import io
import logging
import socket
import time

from frontend.tracing import HideEndpointSecrets, Tracing
from shmserve import config


def test_the_filter_hides_userinfo_and_query():
    hide = HideEndpointSecrets("http://alice:pw1@h:4318/v1/traces?token=T0K")
    record = logging.LogRecord("opentelemetry.exporter", logging.WARNING, "f", 1,
                               "url %s and %s", ("/v1/traces?token=T0K", "alice:pw1"), None)
    hide.filter(record)
    assert record.getMessage() == "url /v1/traces?*** and ***"
    plain = HideEndpointSecrets("http://h:4318/v1/traces")
    record = logging.LogRecord("urllib3.connectionpool", logging.WARNING, "f", 1, "url %s",
                               ("/v1/traces",), None)
    plain.filter(record)
    assert record.getMessage() == "url /v1/traces"


def test_the_exporters_failure_lines_carry_no_secret():
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # refused at once
    root = logging.getLogger()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    saved = root.handlers[:], root.level
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    try:
        cfg = config.load(environ={"SHMSERVE__TRACING__OTLP_ENDPOINT":
                                   f"http://alice:s3cret@127.0.0.1:{port}/v1/traces?token=QT0K"})
        tracing = Tracing(cfg, 0)
        now = time.perf_counter()
        tracing.record({}, "POST /embed", now, now + 0.001, {})
        tracing.processor.force_flush(timeout_millis=1500)
        tracing.close(timeout_s=0.5)
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
    text = stream.getvalue()
    assert "127.0.0.1" in text, text  # the exporter did log its failure
    assert "QT0K" not in text and "s3cret" not in text, text


def test_a_traceback_in_a_json_line_is_hidden_too():
    from shmserve.logs import JsonFormatter

    hide = HideEndpointSecrets("http://h:4318/v1/traces?token=T0K")
    try:
        raise ConnectionError("Max retries exceeded with url: /v1/traces?token=T0K")
    except ConnectionError:
        import sys

        record = logging.LogRecord("opentelemetry.exporter", logging.ERROR, "f", 1,
                                   "failed", None, sys.exc_info())
    hide.filter(record)
    line = JsonFormatter("frontend-0").format(record)
    assert "T0K" not in line and "/v1/traces?***" in line, line
