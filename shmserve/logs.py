"""Logging setup shared by every process: JSON lines (or plain text) on stdout.

supervisord captures each program's stdout into its own rotated file under the run directory.
Fields passed with ``extra={"fields": {...}}`` become top-level JSON keys, so a request id or a
batch id is a field, not part of a message string.
"""

from __future__ import annotations

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


PIPE_BUF = 4096  # a pipe write of at most this many bytes is never split (Linux, POSIX minimum 512)


class BufferedHandler(logging.Handler):
    """Writes whole lines in chunks of at most `chunk` bytes, every `interval` seconds (and when
    a chunk's worth is waiting, on warnings and above, and at exit). One log line per request
    would otherwise be one write to the pipe and one wake-up of supervisord, which reads it: at
    a thousand requests a second that cost a fifth of a core. A SIGKILL loses at most
    `interval` seconds of lines. A chunk of at most PIPE_BUF (4 KiB, `configure` with
    logging.stdout) reaches supervisord whole, so when it writes every program's output to its
    one stdout no line is cut by another program's (a longer single line may be)."""

    def __init__(self, interval: float, fd: int | None = None, chunk: int = 1 << 16) -> None:
        super().__init__()
        self._fd = os.dup(sys.stdout.fileno() if fd is None else fd)
        self._chunk = chunk
        self._lines: list[bytes] = []
        self._size = 0
        self._interval = interval
        self._stop = threading.Event()
        threading.Thread(target=self._flusher, name="log-flush", daemon=True).start()

    def _flusher(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()

    def emit(self, record: logging.LogRecord) -> None:
        # Handler.handle holds self.lock here.
        try:
            line = (self.format(record) + "\n").encode("utf-8", "backslashreplace")
        except RecursionError:
            raise
        except Exception:  # noqa: BLE001 - as logging's own handlers: report, never raise
            self.handleError(record)
            return
        self._lines.append(line)
        self._size += len(line)
        if record.levelno >= logging.WARNING or self._size >= self._chunk:
            self._write()

    def flush(self) -> None:
        with self.lock:
            self._write()

    def _write(self) -> None:
        """Everything waiting, in chunks of whole lines (self.lock held)."""
        lines, self._lines, self._size = self._lines, [], 0
        chunk: list[bytes] = []
        size = 0
        for line in lines:
            if chunk and size + len(line) > self._chunk:
                self._write_all(b"".join(chunk))
                chunk, size = [], 0
            chunk.append(line)
            size += len(line)
        if chunk:
            self._write_all(b"".join(chunk))

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._fd, view):]
            except InterruptedError:
                continue
            except OSError:  # the reader is gone (supervisord stopping): nobody to tell
                return

    def close(self) -> None:
        self._stop.set()
        with self.lock:
            self._write()
            if self._fd >= 0:
                os.close(self._fd)  # our own dup of the descriptor
                self._fd = -1
        super().close()


def configure(cfg: LoggingConfig, process: str, stream: TextIO | None = None) -> None:
    handler: logging.Handler
    if stream is None and cfg.flush_interval_ms > 0:
        handler = BufferedHandler(cfg.flush_interval_ms / 1000,
                                  chunk=PIPE_BUF if cfg.stdout else 1 << 16)
    else:
        handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(JsonFormatter(process) if cfg.format == "json" else TextFormatter(process))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(cfg.level.upper())
    for noisy in ("aiohttp.access",):  # the frontend writes its own access line per request
        logging.getLogger(noisy).setLevel(logging.WARNING)
