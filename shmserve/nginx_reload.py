"""nginx's configuration read again in place (`shmserve restart nginx`, an apply of nginx's
keys): checked first with `nginx -t`, then a SIGHUP through supervisord, waited for until the
new workers run and the old ones have finished; a reload nginx refuses is a restart instead."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from shmserve import render, tls, topology
from shmserve.cli import CliError
from shmserve.config import Config
from shmserve.restarts import ctl, run_ctl, say
from shmserve.startwait import process_info


def check_nginx_conf(cfg: Config) -> None:
    """`nginx -t` on the deployment's nginx.conf: a file nginx refuses (edited by hand) would
    be refused by a reload (nginx goes on with the old one) and, restarted, crash-loop."""
    try:
        render.check_nginx(cfg, render.nginx_binary(cfg))
        tls.check(cfg)  # what nginx -t takes but serves no client with (a CRL of no CA here)
    except (render.RenderError, tls.TlsError) as exc:
        raise CliError(f"{exc}; nginx was left as it runs") from None


# How long a reload waits for nginx's old workers to finish their requests and exit, after its
# new workers have started (they take every new connection from then on).
NGINX_SETTLE_S = 10.0


def reload_nginx(cfg: Config, settle_s: float = NGINX_SETTLE_S) -> int:
    """nginx re-reads its configuration (SIGHUP through supervisord): new workers start on the
    same listening socket and the old ones finish their requests, so no connection is refused.
    Returns once the new workers run and the old ones have exited (up to `settle_s`; an old
    worker still finishing a long request is named): before, a request sent just after
    `restart nginx` or `apply` returned could still meet the old configuration (an outside
    check: the old gzip setting, the old port answering). A stopped or failed nginx is started
    instead."""
    check_nginx_conf(cfg)
    for warning in tls.crl_warnings(cfg):  # the reload starts those refusals (an outside check)
        say(f"shmserve: warning: {warning}", sys.stderr)
    info = {p["name"]: p for p in process_info(cfg)}
    if info.get("nginx", {}).get("statename") != "RUNNING":
        return run_ctl(cfg, "restart", "nginx")
    master = int(info["nginx"].get("pid") or 0)
    old = _children(master)
    log = topology.log_dir(cfg) / "nginx.log"  # its error lines (not with logging.stdout)
    seen = log.stat().st_size if log.exists() else 0
    ctl(cfg, "signal", "HUP", "nginx")
    deadline = time.monotonic() + settle_s
    refused = None
    while time.monotonic() < deadline and not (_children(master) - old):
        time.sleep(0.05)  # the new workers, forked once the new configuration is read
        if refused := _emerg_since(log, seen):
            break
    if refused or not _children(master) - old:
        # nginx kept its old configuration: what `nginx -t` cannot see, such as a rate limit's
        # zone whose key changed (an outside check: apply said "applied", the old limit ran)
        say(f"shmserve: warning: nginx refused to reload its configuration "
            f"({refused or f'no new worker within {settle_s:g} s'}); restarting it instead "
            "(connections are refused for a moment)", sys.stderr)
        return run_ctl(cfg, "restart", "nginx")
    while time.monotonic() < deadline and _children(master) & old:
        time.sleep(0.05)  # the old ones, each once its requests are answered
    left = _children(master) & old
    say("shmserve: nginx reloaded its configuration" + (
        f"; {len(left)} old nginx worker(s) still finishing requests" if left else "") +
        ": nginx closed its idle keep-alive connections, so a client that sent a request on one "
        "at that moment got a connection error and must send it again (the openai client and "
        "shmserve.client do; aiohttp, httpx and requests do not for a POST)")
    return 0


def _emerg_since(log: Path, offset: int) -> str | None:
    """nginx's first [emerg] line written to its log past `offset`: a reload it refused."""
    try:
        with log.open("rb") as f:
            f.seek(offset)
            tail = f.read(1 << 20)
    except OSError:
        return None
    for line in tail.decode(errors="replace").splitlines():
        if "[emerg]" in line:
            return line.split("[emerg]", 1)[1].strip()
    return None


def _children(pid: int) -> set[int]:
    """Pids of a process's children (nginx's master: its workers); empty when it is gone."""
    import psutil

    try:
        return {child.pid for child in psutil.Process(pid).children()}
    except (psutil.Error, ValueError):
        return set()
