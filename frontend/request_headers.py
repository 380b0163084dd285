"""What a request asks for in its headers (and the body fields that stand for them): its
deadline (X-Request-Timeout, KServe's parameters.timeout), its priority (X-Priority), the key
that pins it to an A/B arm; each of this server's headers given at most once."""

from __future__ import annotations

import re
import time

from aiohttp import web

from frontend import schemas
from frontend.app import ARRIVED, CONFIG, TIMEOUT_S, ServedModel
from frontend.errors import ApiError


def sticky_key(request: web.Request, served: ServedModel, user: str | None) -> str | None:
    """The client key that pins a split model's requests to one variant, when configured. An
    empty one (or only whitespace) is none: every request that sent the header empty was one
    client to the split, all on one arm (an outside check)."""
    if not served.sticky_key:
        return None
    key = user if served.sticky_key == "user" else request.headers.get(
        served.sticky_key.removeprefix("header:"))
    return key if key and not key.isspace() else None


def request_priority(request: web.Request, body: int | None, default: int | None
                     ) -> int | None:
    """The body's `priority` field, else the X-Priority header, else `default`."""
    if body is not None:
        return body
    header = once(request, "X-Priority")
    return default if header is None else schemas.parse_priority(header, "X-Priority")


# A decimal number in ASCII, with an exponent if any (shmserve.client sends 1e-06 for a
# microsecond): float() alone also reads "1_0" and other scripts' digits. A leading "+" is
# taken, as X-Priority takes it (an outside check found "+1" taken there, "+5" refused here).
_SECONDS = re.compile(r"\+?([0-9]{1,9}(\.[0-9]{0,9})?|\.[0-9]{1,9})([eE][+-]?[0-9]{1,3})?")


def once(request: web.Request, name: str) -> str | None:
    """A header of this server's that a request gives at most once: given twice, the first
    was taken and the second never read, however the two differed (an outside check)."""
    values = request.headers.getall(name, ())
    if len(values) > 1:
        raise ApiError("invalid_request", f"{name} is given {len(values)} times; give it once",
                       param=name)
    return values[0] if values else None


def deadline_of(request: web.Request, default: float) -> tuple[float, float, str]:
    """When the request's deadline passes (a time.time()), counted from when its frontend began
    it (app.ARRIVED: reading and parsing its body count; they did not, and a 0.05 s deadline
    was answered 504 after ~105 ms under load), with its seconds and what set it (`timeout`)."""
    seconds, by = timeout(request, default)
    return request.get(ARRIVED, time.time()) + seconds, seconds, by


def timeout(request: web.Request, default: float) -> tuple[float, str]:
    """The request's deadline in seconds from now, and what set it (its 504 names it: a 504
    from KServe's parameters.timeout named X-Request-Timeout, an outside check): the shorter
    of X-Request-Timeout (at most 3600) and the protocol's own, else `default`; a longer one
    than nginx waits for (nginx.proxy_read_timeout_s) is cut to a second under it, so the
    frontend's 504 reaches the client before nginx gives up on the request."""
    raw = once(request, "X-Request-Timeout")
    given = request.get(TIMEOUT_S)  # the protocol's own: KServe's parameters.timeout
    if raw is None:
        if given is None:
            return default, "frontends.request_timeout_s"
        value, by = given, "parameters.timeout"
    else:
        value = float(raw) if _SECONDS.fullmatch(raw.strip()) else float("nan")
        if not 0 < value <= 3600:
            raise ApiError("invalid_request", "X-Request-Timeout must be seconds in (0, 3600]",
                           param="X-Request-Timeout")
        value, by = ((value, "X-Request-Timeout") if given is None or value <= given
                     else (given, "parameters.timeout"))
    proxy = request.app[CONFIG].nginx.proxy_read_timeout_s
    cap = proxy - 1 if proxy > 2 else proxy / 2
    return (value, by) if value <= cap else (cap, "nginx.proxy_read_timeout_s")
