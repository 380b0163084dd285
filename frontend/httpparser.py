"""aiohttp's HTTP parser in a frontend: its limits set to what nginx passes (so nginx alone
refuses what is too long or too many, in this server's error shape), and its answer to what it
refuses anyway, in this server's JSON error shape. frontend.__main__ installs both."""

from __future__ import annotations

import logging
import re
import uuid

import orjson
from aiohttp import web

from frontend import metrics
from frontend.errors import ApiError
from shmserve.config import Config

log = logging.getLogger("shmserve.frontend")


def header_limit(cfg: Config) -> int:
    """The longest request line or header line nginx passes (one of its large header
    buffers), so the frontend's parser takes what nginx took: aiohttp's own limit is 8,190
    bytes, and a longer bearer token (a JWT) got aiohttp's plain-text 400 quoting it.
    Over HTTP/2 (nginx.tls_certificate) nginx measures a field as HPACK encoded it, and Huffman
    codes take 5 bits a byte at the least: a field it passes is up to 8/5 of the buffer once
    decoded (a 20,000-byte path got this parser's 400, not nginx's 414). Over HTTP/1.1 nginx
    refuses at the buffer's size first, as before."""
    return nginx_size(cfg.nginx.large_client_header_buffers.split()[1]) * 8 // 5 + 64


def header_count_limit(cfg: Config) -> int:
    """As many header lines as nginx's large header buffers hold (the shortest, `a:b`, takes
    5 bytes), so nginx alone decides which headers are too many (431): aiohttp's own limit is
    128 lines, and 122 short headers got its 400 (an outside check)."""
    count, size = cfg.nginx.large_client_header_buffers.split()
    return int(count) * nginx_size(size) // 5 + 64


_TWICE = re.compile(r"Duplicate '([!#$%&'*+.^_`|~0-9A-Za-z-]{1,64})' header found\.")


def malformed_request(self: web.RequestHandler, request: web.BaseRequest, status: int = 500,
                      exc: BaseException | None = None, message: str | None = None
                      ) -> web.StreamResponse:
    """aiohttp's answer to a request its HTTP parser refused (a control character in a header
    value, an over-long line) or to an error no handler caught: this server's JSON error body,
    naming the kind of fault, instead of aiohttp's text/plain, which quotes the offending bytes
    (a bearer token among them) in the answer and the log. The request's path is not known
    here, so the shape is OpenAI's. Installed over `RequestHandler.handle_error`
    (frontend.__main__); tests/e2e/test_bad_input.py sends such requests through nginx."""
    if request.writer.output_size > 0:  # as aiohttp's: the answer has begun, nothing to add
        raise ConnectionError("response already started; cannot send an error")
    reason = type(exc).__name__ if exc is not None else "error"
    # aiohttp's own words are kept out (they may quote a header's value), except its one
    # message that names a header and no value: a singleton header (Content-Type, Host, ...)
    # given twice, which read as "a control character ..., or a line too long?" (an outside
    # check).
    twice = _TWICE.fullmatch(str(getattr(exc, "message", "")))
    fields = {"status": status, "reason": reason, **({"header_twice": twice[1]} if twice else {})}
    headers = {}
    if status < 500:
        # The parser's refusal (aiohttp's only 4xx here) reaches no middleware, and its request
        # is a stand-in without the headers, the X-Request-ID nginx sent among them: it gets an
        # id of its own, which the client gets back, nginx's access line and this line name, and
        # it is counted as the frontends' answer to a path no route serves. With no X-Request-ID
        # on it nginx counted it as its own 400 (shmserve_nginx_responses_total), and the warning
        # named no request (an outside check). No latency: its time was the parser's alone.
        fields["request_id"] = headers["X-Request-ID"] = uuid.uuid4().hex
        metrics.requests("unmatched", "", str(status), "").inc()
    log.warning("http.malformed_request", extra={"fields": fields})
    if status >= 500:
        error = ApiError("internal_error", "internal error")
    elif twice:
        error = ApiError("bad_request", f"malformed HTTP request: the {twice[1]} header is "
                         "given twice; it may be given once")
    else:
        error = ApiError("bad_request", f"malformed HTTP request ({reason}: a control "
                         "character in a header, or a line too long?)")
    # written as every other error (compact, no charset); its Accept is not known here
    response = web.Response(body=orjson.dumps(error.body()), status=status,
                            content_type="application/json", headers=headers)
    response.force_close()
    return response


def nginx_size(size: str) -> int:
    """Bytes in an nginx size (`16k`, `8m`, `512`)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    size = size.strip().lower()
    return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
