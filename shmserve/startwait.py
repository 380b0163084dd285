"""Waiting for a started deployment to be ready, and saying why it is not: a program that
gave up or keeps exiting as it starts (the end of its log, its last error), nginx unable to
bind its port, or the ready timeout. `shmserve up --wait` and `shmserve restart` use it."""

from __future__ import annotations

import json
import sys
import time

from shmserve import nginx_options, probes, processes, remote, tls, topology
from shmserve.config import Config

LOG_TAIL_LINES = 20


def log_sizes(cfg: Config) -> dict[str, int]:
    """Where each program's log ends now, by program: a start's lines begin there (`down`
    keeps the logs, and an `up --wait` that failed showed an earlier deployment's lines
    above its own error: an outside check)."""
    return {log.stem: log.stat().st_size for log in topology.log_dir(cfg).glob("*.log")}


def wait_ready(cfg: Config, timeout: float, starts: dict[str, int] | None = None) -> int:
    """Poll GET /ready until 200 through nginx and from every frontend (each sees the workers
    through its own heartbeats, so one may be ready a heartbeat before another); on timeout,
    a program that gave up or nginx failing to listen, show the logs. `starts`: where this
    start's lines begin in each log (log_sizes; a 200 through the port means nothing if our
    nginx could not bind it: another server answered)."""
    starts = starts or {}
    nginx_log_start = starts.get("nginx", 0)
    url, context = ready_url(cfg), tls.client_context(cfg)
    frontends = [str(topology.frontend_socket(cfg, i)) for i in range(cfg.frontends.count)]
    deadline = time.monotonic() + timeout
    bind_error = unloaded = refused = failed = None
    watch = processes.StartWatch()
    while True:
        if processes.supervisord_pid(cfg) is None:  # `down` meanwhile: it waited its timeout
            print("shmserve: the deployment stopped (`shmserve down`?) before it was ready; "
                  "nothing of it runs now", file=sys.stderr)
            return 1
        infos = process_info(cfg)
        fatal = [p["name"] for p in infos if p["statename"] == "FATAL"]
        looping = watch.see(infos)
        bind_error = nginx_bind_error(cfg, nginx_log_start)
        if bind_error is not None:
            break
        # The frontends first, on their own sockets: a probe through nginx before each one
        # listens (its imports, its tokenizers) was a line in nginx's log at every `up`, a
        # [crit] "connect() ... failed (2: No such file or directory)" or an [error] "upstream
        # timed out" (an outside check), which alerting on nginx's errors takes for a fault.
        answers = [probes.ready_answer(path) for path in frontends]
        codes = [code for code, _ in answers]
        failed = next(((f"worker-{index}", pid, error) for _, answer in answers if answer
                       for index, pid, error in failed_workers(answer, watch.pids)), None)
        if failed:
            break
        if None not in codes:
            code, body = remote.http(url, context=context)
            refused = certificate_refused(cfg, code, body)
            if refused:
                break
            if code == 200 and all(status == 200 for status in codes):
                print(f"shmserve: ready at {remote.where(cfg)}")
                return 0
            unloaded = not_loading(body)
        if fatal or looping or unloaded or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # cheap polls (an RPC and local probes); up returns sooner
    if refused:
        print(f"shmserve: {refused}; what started keeps running (`shmserve down` stops it)",
              file=sys.stderr)
        return 1
    if failed:
        print(f"shmserve: {failed_start(cfg, *failed, starts)}; then `shmserve down` and "
              "`shmserve up`", file=sys.stderr)
        return 1
    if looping and not fatal and bind_error is None:
        print(f"shmserve: {restart_loop(cfg, looping, watch.pids[looping], starts)}; "
              "then `shmserve down` and `shmserve up`", file=sys.stderr)
        return 1
    if unloaded and not fatal and bind_error is None:
        print(f"shmserve: {unloaded}; the rest is served. Mend it (the worker tries it again "
              "by itself), or `shmserve down`", file=sys.stderr)
        return 1
    print_log_tails(cfg, starts)
    if bind_error is not None:
        why = (f"nginx cannot listen on {cfg.server.host}:{cfg.server.port} ({bind_error}); "
               "`shmserve down`, then choose a free server.port (SHMSERVE__SERVER__PORT)")
    elif fatal:
        why = f"{', '.join(fatal)} gave up (FATAL)"
    else:
        why = f"{url} not ready after {timeout:g} s; raise workers.ready_timeout_s or --timeout"
    print(f"shmserve: {why}; logs in {topology.log_dir(cfg)}; what started keeps running "
          "(`shmserve status`; `shmserve down` stops it)", file=sys.stderr)
    return 1


def failed_workers(answer: dict, pids: dict[str, list[int]]):
    """(index, pid, error) of each worker whose process, one of `pids` by program (those a
    command saw start), a frontend's GET /ready `answer` says failed to start."""
    seen = probes.workers_of(answer) or {}
    for index in seen:
        if failure := probes.load_failure(seen, index, pids.get(f"worker-{index}", [])):
            yield index, *failure


def certificate_refused(cfg: Config, code: int | None, body: bytes) -> str:
    """Why nginx refused the client certificate this command presents on GET /ready (""
    if it did not): /ready needs none, but one sent that does not verify is a 403 on every
    route, and waiting does not change it (an outside check waited the whole ready timeout,
    then blamed it, with a CRL past its nextUpdate, which refuses every certificate)."""
    if code != 403 or not cfg.nginx.tls_client_certificate:
        return ""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, TypeError, KeyError):
        return ""
    if message != nginx_options.error_body(cfg, 495)["error"]["message"]:  # nginx's 495 page
        return ""
    return (f"nginx refuses the certificate this command presents on {ready_url(cfg)} "
            f"(nginx.tls_client_certificate {cfg.nginx.tls_client_certificate}): {message}; "
            "check it against nginx.tls_client_ca, and nginx.tls_client_crl's nextUpdate "
            "(`openssl crl -in CRL -noout -nextupdate`: a CRL past it refuses every "
            "certificate)")


def not_loading(body: bytes) -> str:
    """What GET /ready's body says of models that failed to load processes.STARTS times in a
    row on a worker that serves its others ("" if none), once every worker serves: waiting
    longer would not change it. While another worker still loads, it may serve them (an A/B
    arm's share goes to the arms served: /ready 200 "degraded"), and `up --wait` gave up on a
    loaded machine where the other worker took longer than the three tries (a CI run)."""
    try:
        workers = json.loads(body).get("workers") or []
        if not all(w.get("ready") for w in workers):
            return ""  # one still loading (a worker that fails outright is failed_workers')
        return "; ".join(
            f"worker {w['worker']} serves without {u['model']}, whose load failed "
            f"{u['failures']} times in a row: {u['error']}"
            for w in workers if w.get("ready") for u in w.get("unloaded") or []
            if u["failures"] >= processes.STARTS)
    except (ValueError, TypeError, KeyError, AttributeError):
        return ""


def nginx_bind_error(cfg: Config, start: int) -> str | None:
    """nginx's complaint that it cannot bind its port, logged since byte `start`, if any."""
    try:
        with (topology.log_dir(cfg) / "nginx.log").open("rb") as log:
            log.seek(start)
            text = log.read().decode(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if "bind()" in line and "failed" in line:
            return line.partition("[emerg]")[2].strip() or line.strip()
    return None


def process_info(cfg: Config) -> list[dict]:
    """supervisord's view of every process ([] when unreachable)."""
    return processes.info(cfg)


def tail(log, start: int = 0) -> list[str]:
    """The last lines of `log` from byte `start` on (this start's), at most LOG_TAIL_LINES."""
    try:
        with open(log, "rb") as file:
            file.seek(start if start <= log.stat().st_size else 0)  # rotated: all of it
            text = file.read().decode(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-LOG_TAIL_LINES:]


def print_log_tails(cfg: Config, starts: dict[str, int] | None = None) -> None:
    """The end of each log of this deployment's programs (not the logs an earlier deployment
    with more frontends or workers left in the directory), from `starts` on (log_sizes)."""
    names = {"supervisord", "nginx", "reaper",
             *(f"frontend-{i}" for i in range(cfg.frontends.count)),
             *(f"worker-{i}" for i in range(len(topology.worker_devices(cfg))))}
    for log in sorted(topology.log_dir(cfg).glob("*.log")):
        if log.stem not in names:
            continue
        lines = tail(log, (starts or {}).get(log.stem, 0))
        print(f"--- {log} (last {len(lines)} lines)", file=sys.stderr)
        for line in lines:
            print(line, file=sys.stderr)


def restart_loop(cfg: Config, program: str, pids: list[int],
                 starts: dict[str, int] | None = None) -> str:
    """Show the end of the log of a program that keeps exiting while it starts (its error:
    a model that cannot load, a device it cannot use); return what to say about it."""
    log, lines = show_log_end(cfg, program, starts)
    error = last_error(lines)
    return (f"{program} exits before it is ready (started {len(pids)} "
            f"time{'s' if len(pids) > 1 else ''}, pid{'s' if len(pids) > 1 else ''} "
            f"{', '.join(map(str, pids))}){f': {error}' if error else ''}; fix what the end "
            f"of {log} above says")


def show_log_end(cfg: Config, program: str, starts: dict[str, int] | None):
    """Print the end of `program`'s log (this start's lines: `starts`); (its path, the lines)."""
    log = topology.log_dir(cfg) / f"{program}.log"
    lines = tail(log, (starts or {}).get(program, 0))
    print(f"--- {log} (last {len(lines)} lines)", file=sys.stderr)
    for line in lines:
        print(line, file=sys.stderr)
    return log, lines


def failed_start(cfg: Config, program: str, pid: int, error: str,
                 starts: dict[str, int] | None = None) -> str:
    """Show the end of the log of a program whose process `pid` failed to start (a model that
    cannot load, a device it cannot use: its heartbeats said `error`); return what to say."""
    log, _ = show_log_end(cfg, program, starts)
    return (f"{program} exits before it is ready (pid {pid} failed; supervisord starts it "
            f"again, later each time): {error}; fix what the end of {log} above says")


def last_error(lines: list[str]) -> str:
    """The last error in a program's log lines: the last line of a JSON line's exception (the
    exception itself), or its message; in a text log, the last line (a traceback's last)."""
    for line in reversed(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("level") in ("error", "critical"):
            exception = str(entry.get("exception") or "").strip()
            return exception.splitlines()[-1] if exception else str(entry.get("message", ""))
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


def ready_url(cfg: Config) -> str:
    return f"{remote.base_url(cfg)}/ready"
