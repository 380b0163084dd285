"""CLI commands that call the running stack's admin API through nginx, with admin.token:
``shmserve models``, ``shmserve reload``, ``shmserve split``."""

from __future__ import annotations

import argparse
import json
import math
import socket
import ssl
import sys
import urllib.error
import urllib.request
from http.client import HTTPConnection, HTTPException
from pathlib import Path
from urllib.parse import quote

from shmserve import processes, tls
from shmserve.config import Config


class RemoteError(RuntimeError):
    """The call cannot be made; the message says what to change."""


def list_models(args: argparse.Namespace) -> int:
    status_code, body = admin_call(processes.deployment(args), "GET", "/admin/models")
    return _said(status_code, body)


def reload(args: argparse.Namespace) -> int:
    cfg = processes.deployment(args)
    source = args.source
    if source and not source.startswith("package:"):
        try:
            source = str(Path(source).expanduser().resolve())  # the workers' cwd is not ours
        except RuntimeError:  # ~user of no user: sent as it is, the reload says why
            pass
    body = {"source": source, "revision": args.revision, "variant": args.variant}
    # It answers when every worker has switched: under load, with workers.reload_nice, a large
    # model's load takes a while (~33 s for the default model beside 20 connections on 2
    # cores, an outside check), and the command said nothing meanwhile.
    unit = f"{args.name}@{args.variant}" if args.variant else args.name
    arms = {m.name: {v.name for v in m.variants} for m in cfg.models}
    if cfg.admin.token and not tls.presents_none(cfg) and args.name in arms and (
            not args.variant or args.variant in arms[args.name]):
        # (else nothing waits: the stack's 404 or 422, admin routes off, or nginx's refusal of
        # a CLI without a client certificate says why at once)
        print(f"shmserve: reloading {unit}: every worker hosting it loads and warms the new "
              "weights (beside serving, where it serves it), then switches; waiting for all "
              "of them (at most "
              f"admin.reload_timeout_s, {cfg.admin.reload_timeout_s:g} s; `shmserve models` "
              "shows each worker's state)", file=sys.stderr, flush=True)
    status_code, answer = admin_call(cfg, "POST", f"/admin/models/{quote(args.name)}/reload",
                                     body, timeout=cfg.nginx.proxy_read_timeout_s + 10)
    return _said(status_code, answer)


def split(args: argparse.Namespace) -> int:
    weights: dict[str, float] = {}
    for item in args.weights:
        name, eq, value = item.partition("=")
        if name in weights:  # a dict would keep the last one without a word
            raise RemoteError(f"variant {name!r} is given twice: give each variant one weight")
        try:
            weights[name] = float(value)
        except ValueError:
            raise RemoteError(f"{item!r}: expected VARIANT=WEIGHT, WEIGHT a number") from None
        if not math.isfinite(weights[name]):  # JSON has no nan or inf
            raise RemoteError(f"{item!r}: the weight must be a finite number")
        if not eq:
            raise RemoteError(f"{item!r}: expected VARIANT=WEIGHT")
    status_code, answer = admin_call(processes.deployment(args), "PUT",
                                     f"/admin/models/{quote(args.name)}/split",
                                     {"weights": weights})
    if isinstance(answer, dict) and answer.get("warning"):
        print(f"shmserve: warning: {answer['warning']}", file=sys.stderr)
    return _said(status_code, answer)


def _said(status_code: int, answer: object) -> int:
    """The admin API's answer, as JSON: on stdout when it succeeded (exit 0), else on stderr
    (exit 1), where a script's `2>` looks for failures."""
    ok = status_code == 200
    print(json.dumps(answer, indent=2), file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def admin_call(cfg: Config, method: str, path: str, body: dict | None = None,
               timeout: float = 30.0) -> tuple[int, object]:
    """Call an admin route through nginx with admin.token; (status, decoded JSON body)."""
    if processes.supervisord_pid(cfg) is None:  # not "no token": nothing to ask at all
        raise RemoteError(processes.not_running(cfg))
    if not cfg.admin.token:
        raise RemoteError("admin routes are off in this deployment: set admin.token (in a "
                          "config file, or SHMSERVE__ADMIN__TOKEN=...), then `shmserve apply` "
                          "(the frontends restart one at a time) or `shmserve up`")
    data = json.dumps(body).encode() if body is not None else None
    code, raw = http(base_url(cfg) + path, method, data, timeout=timeout, headers={
        "Authorization": f"Bearer {cfg.admin.token}", "Content-Type": "application/json"},
        context=tls.client_context(cfg))
    if code is None:
        raise RemoteError(f"{base_url(cfg)} did not answer; is the stack up?")
    if code == 403 and tls.presents_none(cfg):
        raise RemoteError("nginx asks for a client certificate (nginx.tls_client_ca) and this "
                          "command has none to present: set nginx.tls_client_certificate and "
                          "nginx.tls_client_key to one those CAs issued, then `shmserve apply`")
    try:
        return code, json.loads(raw)
    except ValueError:
        return code, raw.decode(errors="replace")


def _local_host(cfg: Config) -> str:
    """server.host as this machine reaches it (a wildcard listen address: loopback), bracketed
    where it is IPv6."""
    host = cfg.server.host
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


def base_url(cfg: Config) -> str:
    """Where the deployment answers on this machine."""
    return f"{tls.scheme(cfg)}://{_local_host(cfg)}:{cfg.server.port}"


def where(cfg: Config) -> str:
    """base_url, and the gRPC port's address beside it where server.grpc_port is set."""
    if not cfg.server.grpc_port:
        return base_url(cfg)
    secure = ", TLS" if tls.enabled(cfg) else ""
    return f"{base_url(cfg)} (gRPC {_local_host(cfg)}:{cfg.server.grpc_port}{secure})"


def http(url: str, method: str = "GET", data: bytes | None = None, timeout: float = 2.0,
         headers: dict[str, str] | None = None,
         context: ssl.SSLContext | None = None) -> tuple[int | None, bytes]:
    """(status, body), or (None, b"") when nothing answered. Ignores *_proxy variables.
    `context`: what an https URL's certificate is checked against (tls.client_context)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=context))
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, ValueError):
        return None, b""


class _UnixConnection(HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def http_unix(path: str, target: str, timeout: float = 2.0) -> int | None:
    """GET `target` from the HTTP server on unix socket `path` (a frontend, not through
    nginx): its status, or None when nothing answered."""
    return get_unix(path, target, timeout)[0]


def get_unix(path: str, target: str, timeout: float = 2.0) -> tuple[int | None, bytes]:
    """`http_unix` with the body: (status, body), or (None, b"")."""
    conn = _UnixConnection(path, timeout)
    try:
        conn.request("GET", target)
        response = conn.getresponse()
        return response.status, response.read()
    except (OSError, HTTPException):
        return None, b""
    finally:
        conn.close()
