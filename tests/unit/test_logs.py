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
    """With logging.stdout every program's output meets in supervisord's one stdout: a write
    of at most PIPE_BUF reaches it whole, so each chunk is whole lines within it (a 64 KiB
    buffer was written in one piece, which the pipe may split mid-line)."""
    read_fd, write_fd = pipe
    writes = []
    real = os.write
    monkeypatch.setattr(logs.os, "write", lambda fd, data: (writes.append(bytes(data)),
                                                           real(fd, data))[1])
    handler = logs.BufferedHandler(interval=3600, fd=write_fd, chunk=logs.PIPE_BUF)
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
