"""Logging setup shared by every process: JSON lines (or plain text) on stdout.

supervisord captures each program's stdout into its own rotated file under the run directory.
Fields passed with ``extra={"fields": {...}}`` become top-level JSON keys, so a request id or a
batch id is a field, not part of a message string.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import threading
import time
from typing import TextIO

import orjson

from shmserve.config import LoggingConfig


class JsonFormatter(logging.Formatter):
    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "process": self.process,
            "pid": os.getpid(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            # A field never replaces the line's own keys (a worker's "pid" in a frontend's
            # line would name the wrong process): it is kept beside them instead. The common
            # case, no clash, stays one update (an access line per request).
            clash = fields.keys() & line.keys()
            line.update({f"fields_{k}" if k in clash else k: v for k, v in fields.items()}
                        if clash else fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        try:  # orjson: ~8x json's speed, for a line per request
            return orjson.dumps(line, default=str,
                                option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY).decode()
        except orjson.JSONEncodeError:  # what orjson refuses (integers past 64 bits)
            return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, process: str) -> None:
        super().__init__(f"%(asctime)s %(levelname)s {process} %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            text += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return text


class BufferedHandler(logging.StreamHandler):
    """Writes through a 64 KiB buffer flushed every `interval` seconds (and on warnings and
    above, and at exit). One log line per request would otherwise be one write to the pipe and
    one wake-up of supervisord, which reads it: at a thousand requests a second that cost a
    fifth of a core. A SIGKILL loses at most `interval` seconds of lines."""

    def __init__(self, interval: float, fd: int | None = None) -> None:
        fd = sys.stdout.fileno() if fd is None else fd
        buffered = io.BufferedWriter(io.FileIO(os.dup(fd), "w"), 1 << 16)
        super().__init__(io.TextIOWrapper(buffered, encoding="utf-8", write_through=False))
        self._interval = interval
        self._stop = threading.Event()
        threading.Thread(target=self._flusher, name="log-flush", daemon=True).start()

    def _flusher(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()

    def emit(self, record: logging.LogRecord) -> None:
        # Not StreamHandler.emit: it flushes after every record, which would write each line
        # through to the pipe and defeat the buffer. Handler.handle holds self.lock here.
        try:
            self.stream.write(self.format(record) + self.terminator)
        except RecursionError:
            raise
        except Exception:  # noqa: BLE001 - as logging's own handlers: report, never raise
            self.handleError(record)
        if record.levelno >= logging.WARNING:
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self.flush()
        super().close()
        with self.lock:
            self.stream.close()  # our own dup of the descriptor


def configure(cfg: LoggingConfig, process: str, stream: TextIO | None = None) -> None:
    if stream is None and cfg.flush_interval_ms > 0:
        handler: logging.StreamHandler = BufferedHandler(cfg.flush_interval_ms / 1000)
    else:
        handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(JsonFormatter(process) if cfg.format == "json" else TextFormatter(process))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(cfg.level.upper())
    for noisy in ("aiohttp.access",):  # the frontend writes its own access line per request
        logging.getLogger(noisy).setLevel(logging.WARNING)
