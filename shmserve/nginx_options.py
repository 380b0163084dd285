"""The parts of nginx.conf that options switch on or shape (nginx.gzip, nginx.rate_limit_*,
nginx.cors_allow_origins, logging.flush_interval_ms, the connections each worker may hold), and
the error pages nginx answers itself,
in the frontends' error shapes. shmserve.render fills them into nginx/nginx.conf.
"""

from __future__ import annotations

import math
import os
from typing import Any

from shmserve import tls
from shmserve.config import Config

# Errors nginx produces itself: status -> (type, message), with the same types as the frontends
# (frontend.errors.STATUS) so a client handles one vocabulary.
NGINX_ERRORS: dict[int, tuple[str, str]] = {
    400: ("bad_request", "malformed HTTP request"),
    403: ("forbidden", "admin routes answer loopback clients only (nginx.admin_loopback_only)"),
    404: ("not_found", "no such route"),
    408: ("request_timeout", "the request did not arrive in time "
          "(nginx.client_header_timeout_s, nginx.client_body_timeout_s)"),
    413: ("too_large", "request body larger than nginx.client_max_body_size ({max_body})"),
    414: ("headers_too_large", "request line too long (nginx.large_client_header_buffers)"),
    405: ("method_not_allowed", "no route takes this method (GET /openapi.json lists each "
          "route's)"),
    415: ("unsupported_media_type", "Content-Encoding must be gzip, deflate, br or identity"),
    429: ("overloaded", "more requests from this client than nginx.rate_limit_per_s allows; "
          "retry later"),
    # nginx.max_requests_per_client's refusal (limit_conn_status), answered as a 429: a code of
    # its own so that its message says which limit it was
    460: ("overloaded", "more requests in flight at once from this client than "
          "nginx.max_requests_per_client allows; retry once one is answered"),
    494: ("headers_too_large", "request headers too large (nginx.large_client_header_buffers)"),
    500: ("internal_error", "internal error in nginx; its log says why (`shmserve ctl tail "
          "nginx`: a full run directory, which holds its temp files, or its open-files limit)"),
    502: ("unavailable", "no frontend answered; see `shmserve status`"),
    503: ("unavailable", "no frontend answered; see `shmserve status`"),
    504: ("timeout", "no frontend answered within nginx.proxy_read_timeout_s"),
    501: ("not_implemented", "Transfer-Encoding must be chunked (or none, with Content-Length)"),
    505: ("http_version_not_supported", "HTTP/1.1 or HTTP/1.0 only"),
    # plain HTTP sent to the TLS port (nginx's 497, answered as a 400)
    497: ("bad_request", "this port speaks HTTPS (nginx.tls_certificate): send the request "
          "to https://"),
    # mutual TLS (nginx.tls_client_ca), both answered as 403s
    495: ("forbidden", "the client certificate did not verify against nginx.tls_client_ca "
          "(not issued by one of its CAs, expired, not yet valid, or revoked: "
          "nginx.tls_client_crl)"),
    496: ("forbidden", "this server asks for a client certificate (mutual TLS, "
          "nginx.tls_client_ca): send the request with one"),
}


def error_body(cfg: Config, status: int) -> dict[str, Any]:
    """The frontends' error shape (frontend.errors.ApiError.body): OpenAI's, with our types."""
    kind, message = NGINX_ERRORS[status]
    message = message.format(max_body=cfg.nginx.client_max_body_size)
    return {"error": {"message": message, "type": kind, "param": None, "code": None},
            "message": message}


def kserve_error_body(cfg: Config, status: int) -> dict[str, str]:
    """KServe v2's error shape (frontend.errors.ApiError.kserve_body), for the /v2 routes."""
    return {"error": error_body(cfg, status)["error"]["message"]}


# What nginx.gzip compresses: JSON (vectors as decimal text). Not msgpack, whose float32 bytes
# barely shrink; not /metrics either: nginx matches the type with its parameters unless one is
# a charset, and Prometheus' "text/plain; version=0.0.4; charset=utf-8" would need its version.
GZIP_TYPES = ("application/json",)


def gzip(n) -> str:
    if not n.gzip:
        return "    # nginx.gzip: false, answers go uncompressed"
    # gzip_proxied any: also for clients behind a proxy (a Via header), which nginx leaves out
    # by default; Vary: Accept-Encoding, so a cache keeps both forms apart.
    return (f"    gzip on;\n    gzip_comp_level {n.gzip_level};\n"
            f"    gzip_min_length {n.gzip_min_bytes};\n    gzip_proxied any;\n"
            f"    gzip_vary on;\n    gzip_types {' '.join(GZIP_TYPES)};")


# rate_limit_key api_key: the bearer token as the frontends read it (any case of "Bearer", a
# space, then spaces and tabs, the token, spaces and tabs after it:
# frontend.auth.bearer_matches), so a key is one client however it is written; a request
# without a token is limited by its address.
# "Bearer \t<key>" (a tab after the space) was served by the frontends and counted by its
# address here, a second bucket for the key from every address (an outside check).
_TOKEN_KEY = """    map $http_authorization $shmserve_rate_key {
        "~*^bearer +[ \\t]*(?<token>\\S+)\\s*$" "key $token";
        default "address $binary_remote_addr";
    }
"""
# rate_limit_key certificate: the verified client certificate's subject (nginx.tls_client_ca),
# so one client's certificates, renewed or on several machines, share its rate; a request
# without one (a probe: the others are refused before the limit) by its address.
_CERTIFICATE_KEY = """    map $ssl_client_verify $shmserve_rate_key {
        SUCCESS "certificate $ssl_client_s_dn";
        default "address $binary_remote_addr";
    }
"""
_KEYS = {"ip": ("$binary_remote_addr", ""), "api_key": ("$shmserve_rate_key", _TOKEN_KEY),
         "certificate": ("$shmserve_rate_key", _CERTIFICATE_KEY)}


def rate_limit(n) -> dict[str, str]:
    """nginx's per-client limits: limit_req's zone (nginx.rate_limit_per_s) and limit_conn's
    (nginx.max_requests_per_client) at http level, their use (in a location), or comments where
    both are off; and the Retry-After of a 429: the seconds until the client's next request is
    allowed (1 for requests in flight: one may end any moment), and a second more, which half
    the refusals say (nginx.conf), so a refused burst does not come back all at once."""
    rate, most = n.rate_limit_per_s, n.max_requests_per_client
    if not rate and not most:
        return {"rate_limit_zone": "    # nginx.rate_limit_per_s and max_requests_per_client: "
                                   "0, no per-client limit",
                "rate_limit": "            # no per-client limit",
                "rate_limit_retry_after": "1", "rate_limit_retry_later": "2"}
    key, zone = _KEYS[n.rate_limit_key]
    # Probes and scrapes are not limited (an empty key is not counted), as the client wrote
    # them: their locations match nginx's $uri, which a crafted target reached past the limit
    # (/v1/models/%2e%2e%2Fhealth: GET /v1/models/{model} at a frontend, unlimited)
    exempt = tls.as_written(f"({tls.OPEN_PROBES}|/metrics|{tls.GRPC_OPEN_PROBES})")
    zone += (f'    map $request_uri $shmserve_rate_limit_key {{\n        "~{exempt}" "";\n'
             f"        default {key};\n    }}\n")
    key = "$shmserve_rate_limit_key"
    zones, uses = [], []
    if rate:
        # nginx takes whole requests a second or a minute
        spelled = f"{int(rate)}r/s" if rate == int(rate) else f"{max(1, round(rate * 60))}r/m"
        # A zone per key: nginx keeps a zone across a reload and refuses one whose key changed,
        # so a reload switching ip and api_key left the old limit running (an outside check).
        # Named anew since the probes' exemption made the key a map: the zones of a deployment
        # started before it keep their old key (its first apply after an upgrade reloads, not
        # restarts).
        name = f"shmserve_rate_{n.rate_limit_key}"
        zones.append(f"    limit_req_zone {key} zone={name}:10m rate={spelled};\n"
                     "    limit_req_status 429;\n"
                     # a client over its rate is not the server's fault: nginx logs each
                     # refusal at error by default (alerts on error fired), and a flood is a
                     # line per 429; at info (under error_log's warn) none is written: they
                     # are counted in /metrics instead
                     "    limit_req_log_level info;")
        # nginx refuses burst=0 (it is its default: written only when above)
        uses.append(f"            limit_req zone={name}"
                    + (f" burst={n.rate_limit_burst} nodelay;" if n.rate_limit_burst else ";"))
    if most:
        name = f"shmserve_inflight_{n.rate_limit_key}"  # (a zone per key, as above)
        zones.append(f"    limit_conn_zone {key} zone={name}:10m;\n"
                     "    limit_conn_status 460;  # answered as a 429 (error_page 460 =429)\n"
                     "    limit_conn_log_level info;  # (as limit_req's)")
        uses.append(f"            limit_conn {name} {most};")
    after = max(1, math.ceil(1 / rate)) if rate else 1
    return {"rate_limit_zone": zone + "\n".join(zones),
            "rate_limit": "\n".join(uses),
            "rate_limit_retry_after": str(after), "rate_limit_retry_later": str(after + 1)}


def cors(origins: list[str]) -> dict[str, str]:
    """The map lines that allow `origins` (["*"]: any), the Vary a per-origin answer needs
    (so a cache never serves one origin's answer to another), and the methods nginx's own 405
    names: OPTIONS only where a preflight is answered (without CORS it is a 405 itself)."""
    methods = "GET, HEAD, POST, PUT" + (", OPTIONS" if origins else "")
    if origins == ["*"]:
        return {"cors_origins": '        default "*";', "cors_vary": "",
                "allow_methods": methods}
    lines = [f'        "{origin}" $http_origin;' for origin in origins]
    vary = '        add_header Vary Origin always;' if origins else ""
    return {"cors_origins": "\n".join(['        default "";', *lines]), "cors_vary": vary,
            "allow_methods": methods}


def access_log_buffer(cfg: Config) -> str:
    """nginx's access lines buffered like the other processes' logs (logging.flush_interval_ms):
    4 KiB, a pipe's atomic write (PIPE_BUF), so nginx workers never interleave partial lines."""
    ms = cfg.logging.flush_interval_ms
    return f" buffer=4k flush={max(1, round(ms))}ms" if ms > 0 else ""


# Requests past the frontends' admission that nginx keeps room for, until their 429s come.
CLIENT_MARGIN = 4096
# Connections an nginx worker holds beyond its requests' and idle keep-alive ones: listening
# sockets and the like.
CONNECTION_SLACK = 64


def nginx_workers(cfg: Config) -> int:
    workers = cfg.nginx.worker_processes
    return (os.cpu_count() or 1) if workers == "auto" else workers


def worker_connections(cfg: Config) -> int:
    """nginx's worker_connections: the configured value, or more where it leaves too little
    room. Each request in flight holds a client and an upstream connection, admitted or not (a
    frontend parses a request before it can refuse it with a 429), so room for twice every
    request the frontends admit and CLIENT_MARGIN more, plus each worker's idle upstream
    keep-alive connections. With too few, a burst got connection resets from nginx
    ("worker_connections are not enough") instead of 429s: ~2,000 clients against 4,096
    connections, and 8,000 against 4 x 1,024 admitted when requests past admission were
    counted once (~315 resets; an outside check). And nginx starts closing connections that
    wait for their request once no more than 1/16 of its connections are free (its
    ngx_drain_connections), so the room is 16/15 of what they hold."""
    in_flight = 2 * (cfg.frontends.count * cfg.frontends.max_inflight + CLIENT_MARGIN)
    held = (-(-in_flight // nginx_workers(cfg)) + cfg.nginx.upstream_keepalive
            + CONNECTION_SLACK)
    return max(cfg.nginx.worker_connections, -(-held * 16 // 15) + 1)


def nginx_connections(cfg: Config) -> int:
    """The connections (client or upstream; a descriptor each) nginx's workers may hold."""
    return worker_connections(cfg) * nginx_workers(cfg)
