"""The buffered log handler: lines reach the pipe in batches, warnings at once."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest

from shmserve import logs


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.fixture
def pipe():
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    yield read_fd, write_fd
    os.close(write_fd)
    os.close(read_fd)


def _logger(handler: logging.Handler) -> logging.Logger:
    handler.setFormatter(logs.JsonFormatter("test"))
    log = logging.getLogger(f"shmserve.test.{id(handler)}")
    log.propagate = False  # leaves the root logger's handlers out of it
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    return log


def test_info_lines_wait_for_the_flush_and_then_all_arrive(pipe):
    read_fd, write_fd = pipe
    handler = logs.BufferedHandler(interval=3600, fd=write_fd)  # only an explicit flush writes
    log = _logger(handler)
    for i in range(200):
        log.info("line %d", i, extra={"fields": {"request_id": f"r{i}"}})
    assert _read_all(read_fd) == b""  # buffered: not one write per line
    handler.flush()
    lines = [json.loads(line) for line in _read_all(read_fd).splitlines()]
    assert [line["request_id"] for line in lines] == [f"r{i}" for i in range(200)]
    handler.close()


def test_a_warning_is_written_at_once_with_what_came_before(pipe):
    read_fd, write_fd = pipe
    handler = logs.BufferedHandler(interval=3600, fd=write_fd)
    log = _logger(handler)
    log.info("before")
    log.warning("now")
    messages = [json.loads(line)["message"] for line in _read_all(read_fd).splitlines()]
    assert messages == ["before", "now"]
    handler.close()


def test_the_flusher_thread_writes_within_its_interval(pipe):
    read_fd, write_fd = pipe
    handler = logs.BufferedHandler(interval=0.02, fd=write_fd)
    _logger(handler).info("soon")
    deadline = time.monotonic() + 5
    data = b""
    while not data and time.monotonic() < deadline:
        time.sleep(0.02)
        data = _read_all(read_fd)
    assert json.loads(data)["message"] == "soon"
    handler.close()


def test_close_writes_what_is_left(pipe):
    read_fd, write_fd = pipe
    handler = logs.BufferedHandler(interval=3600, fd=write_fd)
    _logger(handler).info("last words")
    handler.close()
    assert json.loads(_read_all(read_fd))["message"] == "last words"


def test_json_lines_carry_any_field_value():
    """Fields are whatever callers pass: numpy scalars, non-string keys, objects, and integers
    past 64 bits (which orjson refuses: the line falls back to the json module)."""
    import numpy as np

    formatter = logs.JsonFormatter("test")
    record = logging.LogRecord("shmserve.t", logging.INFO, __file__, 1, "m %s", ("x",), None)
    record.fields = {"n": np.int64(3), "f": np.float32(0.5), "keys": {1: "a"}, "obj": object()}
    line = json.loads(formatter.format(record))
    assert (line["message"], line["n"], line["f"], line["keys"]) == ("m x", 3, 0.5, {"1": "a"})
    assert line["obj"].startswith("<object")
    record.fields = {"big": 2**70}
    assert json.loads(formatter.format(record))["big"] == 2**70


def test_a_field_never_replaces_the_lines_own_keys():
    formatter = logs.JsonFormatter("frontend-0")
    record = logging.LogRecord("shmserve.t", logging.INFO, __file__, 1, "m", (), None)
    record.fields = {"pid": 1, "process": "worker-3", "worker": 0}
    line = json.loads(formatter.format(record))
    assert (line["pid"], line["process"]) == (os.getpid(), "frontend-0")
    assert (line["fields_pid"], line["fields_process"], line["worker"]) == (1, "worker-3", 0)


def test_lines_are_written_in_chunks_of_whole_lines(pipe, monkeypatch):
    """A write of at most PIPE_BUF reaches supervisord whole, so each chunk is whole lines
    within it: with logging.stdout every program's output meets in its one stdout, and a log
    file is rotated between its reads (a 64 KiB buffer was written in one piece, which the
    pipe may split mid-line: a line half in each file). The default, as `configure` makes it."""
    read_fd, write_fd = pipe
    writes = []
    real = os.write
    monkeypatch.setattr(logs.os, "write", lambda fd, data: (writes.append(bytes(data)),
                                                           real(fd, data))[1])
    handler = logs.BufferedHandler(interval=3600, fd=write_fd)
    log = _logger(handler)
    for i in range(60):
        log.info("line %d %s", i, "x" * (100 + 37 * i % 400))
    handler.flush()
    got = _read_all(read_fd)
    assert [json.loads(line)["message"].split()[1] for line in got.splitlines()] == [
        str(i) for i in range(60)]
    assert len(writes) > 3 and all(len(w) <= logs.PIPE_BUF and w.endswith(b"\n")
                                   for w in writes)
    handler.close()


def test_colours_and_styles_are_left_out_of_both_formats():
    """transformers' load report puts terminal escapes in its message whether or not it writes
    to a terminal (`ESC[1mBertModel LOAD REPORTESC[0m`): a log has no use for them."""
    record = logging.LogRecord("transformers.modeling_utils", logging.WARNING, __file__, 1,
                               "\x1b[1mBertModel LOAD REPORT\x1b[0m from: %s\n\x1b[38;5;208mx",
                               ("/m",), None)
    assert json.loads(logs.JsonFormatter("w").format(record))["message"] == \
        "BertModel LOAD REPORT from: /m\nx"
    assert logs.TextFormatter("w").format(record).endswith(
        " WARNING w transformers.modeling_utils: BertModel LOAD REPORT from: /m\nx")


def test_text_lines_keep_their_fields_on_the_first_line_before_a_traceback():
    try:
        raise ValueError("bad")
    except ValueError as exc:
        record = logging.LogRecord("shmserve.t", logging.ERROR, __file__, 1, "failed", (),
                                   (ValueError, exc, exc.__traceback__))
    record.fields = logs.failure_fields(record.exc_info[1])
    first, *rest = logs.TextFormatter("w").format(record).splitlines()
    assert first.endswith(" ERROR w shmserve.t: failed error=bad error_type=ValueError")
    assert rest[0] == "Traceback (most recent call last):" and rest[-1] == "ValueError: bad"


def _run_as_program(script: str, fmt: str = "json") -> list[str]:
    """`script` run after logs.configure as a program under supervisord is: stdout and stderr
    into one file (redirect_stderr). Its output's lines."""
    import subprocess
    import sys
    import textwrap

    setup = ("from shmserve import logs\nfrom shmserve.config import LoggingConfig\n"
             f"logs.configure(LoggingConfig(format={fmt!r}), 'prog-0')\n")
    done = subprocess.run([sys.executable, "-c", setup + textwrap.dedent(script)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=60, check=False)
    return done.stdout.splitlines()


def test_uncaught_exceptions_and_warnings_are_json_lines():
    """Under logging.format json every line a program writes is one JSON object: an uncaught
    exception (in the main thread or another) and Python's warnings were plain text on
    stderr, which a log shipper taking `{` lines never saw."""
    lines = _run_as_program("""
        import threading, warnings
        warnings.warn("an old way", UserWarning)
        side = threading.Thread(target=lambda: {}["gone"], name="side")
        side.start(); side.join()
        raise ValueError("cannot start")
    """)
    assert lines and all(line.startswith("{") for line in lines), lines
    warned, in_thread, uncaught = (json.loads(line) for line in lines)
    assert (warned["level"], warned["logger"], warned["process"]) == \
        ("warning", "py.warnings", "prog-0")
    assert "UserWarning: an old way" in warned["message"]
    assert (in_thread["level"], in_thread["error_type"], in_thread["error"], in_thread["thread"]) \
        == ("error", "KeyError", "'gone'", "side")
    assert (uncaught["level"], uncaught["message"], uncaught["error"], uncaught["error_type"]) \
        == ("critical", "process.uncaught_exception", "cannot start", "ValueError")
    assert uncaught["exception"].startswith("Traceback (most recent call last):")
    assert uncaught["exception"].splitlines()[-1] == "ValueError: cannot start"


def test_text_format_shows_an_uncaught_exception_as_a_readable_traceback():
    lines = _run_as_program('raise ValueError("cannot start")', fmt="text")
    assert "CRITICAL prog-0 shmserve: process.uncaught_exception error=cannot start " \
        "error_type=ValueError" in lines[0]
    assert lines[1] == "Traceback (most recent call last):" and \
        lines[-1] == "ValueError: cannot start"


def test_a_library_logger_with_its_own_stderr_handler_is_adopted():
    """transformers (and huggingface_hub) put a plain stderr handler on their logger when
    imported, transformers without propagation: its load report reached a JSON log as ~25
    lines of text. `adopt` sends their records through the program's lines, at their level."""
    lines = _run_as_program("""
        import logging, sys
        for name, propagate in (("lib_a", False), ("lib_b", True)):
            lib = logging.getLogger(name)
            lib.addHandler(logging.StreamHandler(sys.stderr))
            lib.propagate = propagate
        logging.getLogger("lib_a.sub").warning("before")
        logs.adopt(("lib_a", "lib_b"))
        logging.getLogger("lib_a.sub").warning("a report\\nof two lines")
        logging.getLogger("lib_b").error("b")
    """)
    assert lines[0] == "before"  # its own handler's plain line, until adopted
    rest = [json.loads(line) for line in lines[1:]]
    assert [(r["logger"], r["level"], r["message"]) for r in rest] == [
        ("lib_a.sub", "warning", "a report\nof two lines"), ("lib_b", "error", "b")]


def test_failed_says_the_error_with_or_without_its_traceback():
    records = []
    log = logging.getLogger("shmserve.test.failed")
    log.propagate = False
    handler = logging.Handler()
    handler.emit = records.append
    log.addHandler(handler)
    exc = ValueError("no such file")
    logs.failed(log, "frontend.failed", exc, traceback=False)
    try:
        raise OSError("gone")
    except OSError as raised:
        logs.failed(log, "frontend.failed", raised)
    plain, traced = (json.loads(logs.JsonFormatter("frontend-0").format(r)) for r in records)
    assert {k: plain[k] for k in ("level", "error", "error_type", "exception")} == {
        "level": "error", "error": "no such file", "error_type": "ValueError",
        "exception": "ValueError: no such file"}
    assert (traced["error"], traced["error_type"]) == ("gone", "OSError")
    assert traced["exception"].startswith("Traceback") and \
        traced["exception"].endswith("OSError: gone")
