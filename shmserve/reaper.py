"""``python -m shmserve.reaper``: supervisord's event listener that forgets exited processes'
live gauges (prometheus_client's `mark_process_dead`), so a killed worker's queue depth or a
killed frontend's in-flight count never lingers in GET /metrics.

supervisord runs it as ``[eventlistener:reaper]`` for the PROCESS_STATE_EXITED, _STOPPED,
_BACKOFF and _FATAL events. EXITED and STOPPED name the pid; BACKOFF (a process that died while
starting) does not, so every event also sweeps the metrics directory for files of processes that
no longer run (`shmserve.metrics_files.mark_dead`); it sweeps once when it starts too, for what died
while it was not listening.

At supervisord's stop it is the last program stopped: on its SIGTERM it removes the socket
files the frontends left (they keep them while they restart, so that nginx's connects are
refused rather than finding no file, which nginx logs at level crit) that no process listens on.

It also counts what nginx answers itself (shmserve.nginx_stats), and reads the TLS files'
dates every minute (shmserve_tls_expiry_timestamp_seconds), on threads: the one program of a
deployment that always runs.

The listener protocol owns stdout; this process logs to stderr (its supervisord log file).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Callable, TextIO

from prometheus_client import Counter, Gauge

from shmserve import config, logs, metrics, metrics_files, tls

log = logging.getLogger("shmserve.reaper")

# Every program's exits as supervisord reports them: PROCESS_STATE_EXITED for a process that had
# run startsecs (1 s), expected "false" a crash or a kill (supervisord restarts it), "true" an
# exit code the program section expects; and PROCESS_STATE_BACKOFF for one that exited sooner,
# while starting (a crash at import or on a full disk: no EXITED event, so a fast crash loop
# counted nothing), always "false". Stops (supervisorctl stop, restart, down) are not exits.
# Counted in the metrics directory, as every process's counters are, so a restarted reaper
# loses none.
EXITS = Counter("shmserve_process_exits", "Program exits seen by supervisord, by program; "
                "expected=false: a crash or a kill", ["program", "expected"])


# The TLS files' dates, as on disk (what nginx reads at its next reload or start): an alert's
# (ShmserveTlsExpiring), where `shmserve status` warns only when asked. A restarted reaper's
# replace its predecessor's (live: the dead process's file is swept).
TLS_EXPIRY = Gauge("shmserve_tls_expiry_timestamp_seconds", "The earliest notAfter (a "
                   "certificate) or nextUpdate (a CRL) in the TLS file a config key names, "
                   "seconds since the epoch", ["key", "kind"], multiprocess_mode="livemax")
TLS_LOOK_S = 60.0
TLS_ONLY = ("shmserve_tls_expiry_timestamp_seconds",)  # exposed with TLS on only
# Whether nginx, which runs on the files it read last, would start on them as they are now
# (render.nginx_start_refusal: `nginx -t`, and a CRL of no CA): a TLS file renewed wrong, or
# part way, or a key that does not match leaves nginx serving until its next restart, then
# down. `shmserve status` says why; this is for the alert (ShmserveNginxWouldNotStart).
NGINX_REFUSED = Gauge("shmserve_nginx_start_refused", "1 while nginx would not start on its "
                      "config and the files it names as they are now (nginx -t refuses them, "
                      "or a CRL of no CA of the clients): it serves on with what it read at "
                      "its last reload", multiprocess_mode="livemax")
NGINX_LOOK_S = 60.0


def watch_tls_dates(cfg: config.Config, stopped: threading.Event,
                    every_s: float = TLS_LOOK_S) -> None:
    """Set TLS_EXPIRY from the files now, then every `every_s` until `stopped`."""
    def look() -> None:
        for key, kind, when in tls.dated_files(cfg):
            # NaN while the file reads no date: it kept the last date read, which said all was
            # well (a review); shmserve_nginx_start_refused says the file is wrong
            TLS_EXPIRY.labels(key, kind.lower()).set(float("nan") if when is None else when)
    _every(look, stopped, every_s, "reaper.tls_dates_failed")


def _every(look: Callable[[], None], stopped: threading.Event, every_s: float,
           failed: str) -> None:
    """`look()` now, then every `every_s` until `stopped`; a failure is logged as `failed` and
    tried again next time (a thread's loop)."""
    while True:
        try:
            look()
        except Exception:  # noqa: BLE001
            log.exception(failed)
        if stopped.wait(every_s):
            return


def watch_nginx_files(cfg: config.Config, stopped: threading.Event,
                      every_s: float = NGINX_LOOK_S) -> None:
    """Set NGINX_REFUSED now, then every `every_s` until `stopped`; log each change."""
    from shmserve import render

    said: list[str | None] = [None]

    def look() -> None:
        refusal = render.nginx_start_refusal(cfg)
        NGINX_REFUSED.set(refusal is not None)
        if refusal != said[0]:
            if refusal is not None:
                log.error("reaper.nginx_would_not_start", extra={"fields": {"reason": refusal}})
            elif said[0] is not None:
                log.info("reaper.nginx_would_start")
            said[0] = refusal
    _every(look, stopped, every_s, "reaper.nginx_check_failed")


def start(cfg: config.Config) -> None:
    """Every program's exit counts at zero, so an alert on increase() sees the first crash."""
    from shmserve import topology

    # the reaper too: a new one counts the exit of the one before it
    programs = ["nginx", "reaper", *(f"frontend-{i}" for i in range(cfg.frontends.count)),
                *(f"worker-{i}" for i in range(len(topology.worker_devices(cfg))))]
    for program in programs:
        for expected in ("true", "false"):
            EXITS.labels(program, expected)


def handle(event: str, payload: str) -> list[int]:
    """Mark dead what `event` reports, and whatever else died; returns the pids marked."""
    directory = metrics.multiproc_dir()
    if directory is None or not directory.is_dir():
        return []
    fields = dict(token.split(":", 1) for token in payload.split() if ":" in token)
    if event in ("PROCESS_STATE_EXITED", "PROCESS_STATE_BACKOFF") and fields.get("processname"):
        EXITS.labels(fields["processname"],
                     "true" if fields.get("expected") == "1" else "false").inc()
    pids = [int(fields["pid"])] if fields.get("pid", "").isdigit() else []
    dead = metrics_files.mark_dead(directory, pids)
    if dead:
        log.info("reaper.marked_dead", extra={"fields": {
            "event": event, "program": fields.get("processname"), "pids": dead}})
    return dead


def serve(stdin: TextIO, stdout: TextIO, on_stopping: Callable[[], object] = lambda: None
          ) -> None:
    from supervisor.childutils import get_headers, listener

    while True:
        listener.ready(stdout)
        line = stdin.readline()
        if not line:
            return  # supervisord is gone
        headers = get_headers(line)
        payload = stdin.read(int(headers["len"]))
        try:
            if headers.get("eventname") == "SUPERVISOR_STATE_CHANGE_STOPPING":
                on_stopping()
            else:
                handle(headers.get("eventname", ""), payload)
        except Exception:  # noqa: BLE001 - one bad event must not stop the listener
            log.exception("reaper.failed")
        listener.ok(stdout)


def drain_frontends(cfg: config.Config, config_path: str) -> list[int]:
    """supervisord is stopping (`shmserve down`, its SIGTERM): SIGTERM the frontends now, so
    they drain while nginx finishes its requests. supervisord stops nginx first and the
    frontends only once nginx has exited, and nginx waited for requests the frontends held
    behind a workers' backlog until supervisord SIGKILLed it, which cut them (an outside
    check). Draining, a frontend answers what its workers have not by its drain's end (503),
    so nginx can finish; supervisord's own SIGTERM later changes nothing (frontend.__main__).
    The pids signalled."""
    import os

    from shmserve.hung import running_frontends

    signalled = []
    for pid in running_frontends(config_path, cfg.frontends.count).values():
        try:
            os.kill(pid, signal.SIGTERM)
            signalled.append(pid)
        except ProcessLookupError:
            pass
    log.info("reaper.frontends_draining", extra={"fields": {"pids": signalled}})
    return signalled


def sweep_sockets(cfg: config.Config) -> list[str]:
    """Remove the frontends' socket files (HTTP, and gRPC's with server.grpc_port) no process
    listens on; the paths removed. (gRPC's were left after a foreground stop: an outside
    check.)"""
    from shmserve import nginxrun, topology

    removed = []
    paths = [topology.frontend_socket(cfg, i) for i in range(cfg.frontends.count)]
    if cfg.server.grpc_port:
        paths += [topology.frontend_grpc_socket(cfg, i) for i in range(cfg.frontends.count)]
    for path in paths:
        if path.exists() and not nginxrun.listening(path):  # a live frontend's is kept
            path.unlink(missing_ok=True)
            removed.append(str(path))
    return removed


def count_nginx_answers(cfg: config.Config):
    """Count what nginx answers itself (shmserve.nginx_stats) on a thread of this process, the
    one program of the deployment that always runs."""
    from shmserve import nginx_stats, topology

    reader = nginx_stats.Reader(topology.nginx_answers_log(cfg))
    reader.start()
    return reader


def main() -> int:
    parser = argparse.ArgumentParser(prog="shmserve.reaper")
    parser.add_argument("--config", required=True, help="the resolved config.json in the run dir")
    args = parser.parse_args()
    # supervisord stops it with SIGTERM: exit 0, so the stop reads "exit status 0" (INFO), not
    # "terminated by SIGTERM" (WARN) in supervisord's log at every `down`
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    cfg = config.load_resolved(args.config)

    reader = None
    stopped = threading.Event()

    def stop(*_) -> None:
        sweep_sockets(cfg)  # the last program stopped: the frontends are gone
        stopped.set()
        if reader is not None:
            reader.stop()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    logs.configure(cfg.logging, "reaper", sys.stderr)  # stdout speaks to supervisord
    log.info("reaper.started", extra={"fields": {"dir": str(metrics.multiproc_dir())}})
    start(cfg)
    reader = count_nginx_answers(cfg)
    if tls.enabled(cfg):
        threading.Thread(target=watch_tls_dates, args=(cfg, stopped), name="tls-dates",
                         daemon=True).start()
    threading.Thread(target=watch_nginx_files, args=(cfg, stopped), name="nginx-files",
                     daemon=True).start()
    handle("STARTED", "")  # what died while no reaper listened (its own restart)
    serve(sys.stdin, sys.stdout, lambda: drain_frontends(cfg, args.config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
