"""The gRPC part of nginx.conf (server.grpc_port), from nginx/grpc.conf: an upstream of the
frontends' gRPC sockets and a server on the gRPC port, HTTP/2 with or without TLS."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping

from shmserve import tls, topology
from shmserve.config import Config
from shmserve.nginx_options import NGINX_ERRORS

TEMPLATE = Path(__file__).resolve().parent.parent / "nginx" / "grpc.conf"

# nginx's own errors as gRPC status codes (grpc/grpc doc/statuscodes.md): a malformed request
# INVALID_ARGUMENT (3), a body past nginx.client_max_body_size or a client past its rate limit
# or its requests in flight RESOURCE_EXHAUSTED (8), no frontend UNAVAILABLE (14), a timeout
# DEADLINE_EXCEEDED (4). The frontends' answers have their own table
# (frontend.grpc_messages.STATUS_CODES), the same codes but 413: there it is a request past the
# limits (INVALID_ARGUMENT), here a message's bytes (gRPC's RESOURCE_EXHAUSTED for a message too
# large). A client certificate missing or not verifying (nginx.tls_client_ca) UNAUTHENTICATED
# (16).
GRPC_STATUS = {400: 3, 408: 4, 413: 8, 415: 12, 429: 8, 460: 8, 494: 3, 495: 16, 496: 16,
               500: 13, 502: 14, 503: 14, 504: 4}
# Where the gRPC port's message is not the HTTP port's: a grpc-encoding grpc cannot decode.
GRPC_MESSAGES = {415: "grpc-encoding must be identity, gzip or deflate"}
GRPC_HEADERS = {415: 'add_header grpc-accept-encoding "identity,deflate,gzip" always;'}
# nginx's internal codes as the HTTP port answers them (nginx.conf's error_page ... =STATUS),
# the status the answers log counts (shmserve_nginx_responses_total) on both ports
ANSWERED_AS = {460: 429, 494: 431, 495: 403, 496: 403}


def block(cfg: Config, binary: str, common: Mapping[str, str],
          fill: Callable[[str, Mapping[str, str]], str]) -> str:
    """nginx.conf's @grpc@: the rendered block (with the values of nginx.conf's own
    placeholders it shares, `common`), or a comment when gRPC is off."""
    if not cfg.server.grpc_port:
        return "    # no gRPC: server.grpc_port is 0"
    host = f"[{cfg.server.host}]" if ":" in cfg.server.host else cfg.server.host
    servers = [f'        server "unix:{topology.frontend_grpc_socket(cfg, i)}" max_fails=0;'
               for i in range(cfg.frontends.count)]
    tls_values = tls.nginx_values(cfg, binary, grpc=True)
    max_body = cfg.nginx.client_max_body_size
    pages, locations = [], []
    retry_after = {429: common["rate_limit_retry_after"], 460: "1", 502: "1", 503: "1"}
    for status, code in GRPC_STATUS.items():
        message = GRPC_MESSAGES.get(status) or NGINX_ERRORS[status][1].format(max_body=max_body)
        # named by the HTTP status it counts as, then nginx's own where they differ
        name = "/".join(dict.fromkeys((str(ANSWERED_AS.get(status, status)), str(status))))
        pages.append(f"        error_page {status} = /_shmserve_grpc_error/{name};")
        locations.append(f"""        location = /_shmserve_grpc_error/{name} {{
            internal;
            default_type application/grpc;
            add_header grpc-status {code} always;
            add_header grpc-message "{message}" always;
            add_header X-Request-ID $shmserve_response_request_id always;
            {GRPC_HEADERS.get(status, "# no other header")}
            {f"add_header Retry-After {retry_after[status]} always;" if status in retry_after else
             "# no Retry-After"}
            return 200;
        }}""")
    return fill(TEMPLATE.read_text(), {
        **common,
        "grpc_upstream_servers": "\n".join(servers),
        "grpc_error_pages": "\n".join(pages),
        "grpc_error_locations": "\n".join(locations),
        "grpc_listen": f"{host}:{cfg.server.grpc_port}",
        "grpc_listen_params": tls_values["listen_tls"],
        "grpc_tls": tls_values["tls"],
        "grpc_probe_paths": tls_values["probe_paths"],
        "grpc_stream_idle_timeout": f"{cfg.nginx.grpc_stream_idle_timeout_s}s",
        "grpc_client_cert_map": tls_values["client_cert_map"],
        "grpc_client_cert_check": tls_values["client_cert_check"],
    })
