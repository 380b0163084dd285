"""Logging setup shared by every process: JSON lines (or plain text) on stdout.

supervisord captures each program's stdout (and its stderr, redirected there) into its own
rotated file under the run directory.
Fields passed with ``extra={"fields": {...}}`` become top-level JSON keys, so a request id or a
batch id is a field, not part of a message string. What would otherwise reach stderr as plain
text goes through the same lines: an uncaught exception, Python's warnings (`configure`), and
the records of libraries that install their own stderr handler (`adopt`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from types import TracebackType
from typing import TextIO

import orjson

from shmserve.config import LoggingConfig

# Terminal colours and styles (CSI ... m) in a message: transformers' load report puts them in
# whether or not it writes to a terminal. A log file or a JSON string has no use for them.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _plain(message: str) -> str:
    return _ANSI.sub("", message) if "\x1b" in message else message


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
            "message": _plain(record.getMessage()),
        }
        fields = getattr(record, "fields", None)
        if fields:
            # A field never replaces the line's own keys (a worker's "pid" in a frontend's
            # line would name the wrong process): it is kept beside them instead. The common
            # case, no clash, stays one update (an access line per request).
            clash = fields.keys() & line.keys()
            line.update({f"fields_{k}" if k in clash else k: v for k, v in fields.items()}
                        if clash else fields)
        if record.exc_info:  # as a filter may have rewritten it (frontend.tracing's)
            line["exception"] = record.exc_text or self.formatException(record.exc_info)
        try:  # orjson: ~8x json's speed, for a line per request
            return orjson.dumps(line, default=str,
                                option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY).decode()
        except orjson.JSONEncodeError:  # what orjson refuses (integers past 64 bits)
            return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, process: str) -> None:
        super().__init__(f"%(asctime)s %(levelname)s {process} %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return _plain(super().format(record))

    def formatMessage(self, record: logging.LogRecord) -> str:
        # Fields on the message's line, before a traceback (format adds it after this).
        text = super().formatMessage(record)
        fields = getattr(record, "fields", None)
        if fields:
            text += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return text


PIPE_BUF = 4096  # a pipe write of at most this many bytes is never split (Linux, POSIX minimum 512)
# Lines waiting that are written at once, before the interval ends, in chunks as always (a
# chunk's size as the threshold woke supervisord 16x as often)
WAKE_BYTES = 1 << 16


class BufferedHandler(logging.Handler):
    """Writes whole lines in chunks of at most PIPE_BUF bytes, every `interval` seconds (and when
    WAKE_BYTES are waiting, on warnings and above, and at exit). One log line per request
    would otherwise be one write to the pipe and one wake-up of supervisord, which reads it: at
    a thousand requests a second that cost a fifth of a core. A SIGKILL loses at most
    `interval` seconds of lines. A chunk of at most PIPE_BUF (4 KiB) reaches supervisord
    whole, so when it writes every program's output to its one stdout (logging.stdout) no line
    is cut by another program's (a longer single line may be), and when it writes a program's
    own log file no line is cut by a rotation: a 64 KiB write into a pipe that still held data
    was read in parts, and supervisord rotates between the reads it writes out (an outside
    check: 16 of 144 rotations left a line half in each file, a lagging supervisord)."""

    def __init__(self, interval: float, fd: int | None = None) -> None:
        super().__init__()
        self._fd = os.dup(sys.stdout.fileno() if fd is None else fd)
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
        if record.levelno >= logging.WARNING or self._size >= WAKE_BYTES:
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
            if chunk and size + len(line) > PIPE_BUF:
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
        handler = BufferedHandler(cfg.flush_interval_ms / 1000)
    else:
        handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(JsonFormatter(process) if cfg.format == "json" else TextFormatter(process))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(cfg.level.upper())
    for noisy in ("aiohttp.access",):  # the frontend writes its own access line per request
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # What Python itself would print on stderr, which supervisord writes into the same file:
    # as plain text a JSON log's shipper would drop it (a frontend that could not start left
    # only a traceback).
    logging.captureWarnings(True)  # logger py.warnings, level warning
    sys.excepthook = _uncaught
    threading.excepthook = lambda args: _uncaught(
        args.exc_type, args.exc_value, args.exc_traceback,
        thread=args.thread.name if args.thread else None)


def failure_fields(exc: BaseException) -> dict:
    """An error's fields on a line that reports it: `error` (its message) and `error_type`."""
    return {"error": str(exc), "error_type": type(exc).__name__}


def failed(log: logging.Logger, message: str, exc: BaseException, traceback: bool = True) -> None:
    """Log a process's fatal error at level error: `failure_fields`, and `exception`: the
    traceback, or (`traceback` False: an error whose message says what to change, which a
    traceback at every restart only buried) "Type: message". Either way the field's last line
    is the error, which `shmserve up --wait` shows (shmserve.startwait.last_error)."""
    if traceback:
        log.error(message, exc_info=exc, extra={"fields": failure_fields(exc)})
    else:
        log.error(message, extra={"fields": {**failure_fields(exc),
                                             "exception": f"{type(exc).__name__}: {exc}"}})


def _uncaught(exc_type: type[BaseException], exc: BaseException,
              tb: TracebackType | None, thread: str | None = None) -> None:
    """sys.excepthook and threading.excepthook: the exception as a log line (level critical
    in the main thread, which then exits; error in another), where Python printed it to
    stderr as text."""
    if issubclass(exc_type, SystemExit):  # threading's hook is called for it too: not an error
        return
    fields = failure_fields(exc)
    if thread is not None:
        fields["thread"] = thread
    logging.getLogger("shmserve").log(
        logging.CRITICAL if thread is None else logging.ERROR, "process.uncaught_exception",
        exc_info=(exc_type, exc, tb), extra={"fields": fields})


LIBRARY_LOGGERS = ("transformers", "huggingface_hub")


def adopt(names: tuple[str, ...] = LIBRARY_LOGGERS) -> None:
    """Send the records of these libraries' loggers through this process's own lines (JSON or
    text, at their level), not through the plain stderr handler each puts on its logger when
    it is imported: call it once they are imported. transformers' handler also stops its
    records from propagating, and wrote a load report as ~25 lines of text per model load
    into a JSON log."""
    for name in names:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True
