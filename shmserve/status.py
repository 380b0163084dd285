"""``shmserve status``: what the running server says about itself, as a few tables (or JSON).

Each process's supervisord state, pid, uptime and resident memory; per worker its readiness,
queue depth, recent throughput, batch shape and memory. Everything is read from outside, as a
user would: supervisord's XML-RPC socket, then GET /ready and GET /metrics through nginx (when
nginx does not answer, the per-process and per-worker figures are read from a frontend's socket
directly, and the state line says so). Rates are differences between two samples (one second
apart, or the --watch interval).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, TextIO

import psutil
from prometheus_client.parser import text_string_to_metric_families

from shmserve import processes

Fetch = Callable[[str], tuple[int | None, bytes]]
Labels = frozenset[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # monotonic seconds
    processes: list[dict]  # supervisord's getAllProcessInfo
    ready_code: int | None
    ready: dict  # GET /ready's body ({} when it did not answer)
    metrics: dict[str, dict[Labels, float]] = field(default_factory=dict)  # sample name ->
    supervisord_pid: int | None = None  # from its pid file (it is not among its programs)
    direct: bool = False  # /ready's workers and /metrics read from a frontend, not nginx
    nginx_metrics: int | None = None  # what nginx answered /metrics, where it answered
    # STOPPED by a restart killed between its stop and its start (shmserve.restart_record)
    stopped_by_restart: list[str] = field(default_factory=list)

    def total(self, name: str, **labels: str) -> float | None:
        """The sum of the samples of `name` whose labels include `labels`; None if none."""
        found = [v for k, v in self.metrics.get(name, {}).items() if set(labels.items()) <= k]
        return sum(found) if found else None


def take(base_url: str, fetch: Fetch, processes: Callable[[], list[dict]],
         supervisord_pid: Callable[[], int | None] = lambda: None,
         direct: Fetch | None = None,
         by_restart: Callable[[list[dict]], list[str]] = lambda procs: []) -> Sample:
    """`direct(target)` GETs a path from a frontend, not through nginx: the figures still come
    when nginx is stopped or stuck (they showed no memory and no worker rows, an outside
    check); the state stays what nginx answered. When nginx did not answer /ready, /metrics is
    not asked of it too: a stuck nginx (SIGSTOP) cost each fetch its whole timeout, and status
    took ~18 s (an outside check)."""
    procs = processes()
    code, body = fetch(f"{base_url}/ready")
    ready = _object(body)
    mcode, mbody = fetch(f"{base_url}/metrics") if code is not None else (None, b"")
    direct_used, nginx_metrics = False, mcode
    if mcode != 200 and direct is not None:
        mcode, mbody = direct("/metrics")
        if mcode == 200:
            direct_used = True
            if "workers" not in ready:
                ready = {**_object(direct("/ready")[1]), **ready}
    return Sample(time.monotonic(), procs, code, ready,
                  parse_metrics(mbody.decode(errors="replace")) if mcode == 200 else {},
                  supervisord_pid(), direct_used, nginx_metrics, by_restart(procs))


def _object(body: bytes) -> dict:
    try:
        value = json.loads(body) if body else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def parse_metrics(text: str) -> dict[str, dict[Labels, float]]:
    out: dict[str, dict[Labels, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name][frozenset(s.labels.items())] = s.value
    return dict(out)


def render(cur: Sample, prev: Sample | None, title: str) -> str:
    lines = [f"{title}: {_state(cur)}", ""]
    lines += _table(["PROGRAM", "STATE", "PID", "UPTIME", "RSS"], [
        [p["name"], p["state"], str(p["pid"] or "-"), _duration(p["uptime_s"]),
         _bytes(p["rss_bytes"])] for p in processes_of(cur)])
    lines.append("")
    lines += _table(["WORKER", "DEVICE", "READY", "QUEUE", "TEXTS/S", "BATCHES/S", "TEXTS/BATCH",
                     "PADDING", "DEV ALLOC", "DEV RESERVED", "FRAG", "RSS"], [
        [str(w["worker"]), str(w["device"] if w["device"] not in (None, "loading")
                               else w["configured_device"] or w["device"] or "-"),
         "yes" if w["ready"] else ("failing" if w["load_error"] else
                                   "loading" if w["alive"] else "no"),
         _num(w["queued_texts"], 0),
         _num(w["texts_per_s"]), _num(w["batches_per_s"]), _num(w["texts_per_batch"]),
         _num(w["padding"], 2), _bytes(w["device_allocated_bytes"]),
         _bytes(w["device_reserved_bytes"]), _num(w["fragmentation"], 2), _bytes(w["rss_bytes"])]
        for w in workers_of(cur, prev)])
    apart = [w for w in workers_of(cur, prev) if w["diverged"]]
    if apart:
        lines.append("")
        lines += [f"worker {w['worker']}: serves {', '.join(w['diverged'])} apart from the run "
                  "state (its reloaded source is gone or no longer loads: `shmserve models` "
                  "says which revision; a reload mends it)" for w in apart]
    failing = [w for w in workers_of(cur, prev) if w["load_error"] and not w["ready"]]
    if failing:
        lines.append("")
        lines += [f"worker {w['worker']}: its load failed {w['failed_loads']} time(s) in a row "
                  f"(it starts again): {w['load_error']}" for w in failing]
    without = [(w, u) for w in workers_of(cur, prev) if w["ready"] for u in w["unloaded"]]
    if without:
        lines.append("")
        lines += [f"worker {w['worker']}: serves without {u['model']}, whose load failed "
                  f"{u['failures']} time(s) in a row (tried again in {u['retry_in_s']:g} s): "
                  f"{u['error']}" for w, u in without]
    crowded = [p for p in processes_of(cur)
               if p.get("max_fds") and p["open_fds"] >= FDS_NEAR * p["max_fds"]]
    if crowded:
        lines.append("")
        lines += [f"{p['name']}: {p['open_fds']} of its {p['max_fds']} file descriptors open "
                  "(its open-files limit: at it, connections fail quietly; raise `ulimit -n` "
                  "where `shmserve up` runs, then restart it)" for p in crowded]
    full = _delta(cur, prev, "shmserve_frontend_refused_total", reason="shm_full")
    if full:  # others filled /dev/shm: 503s, said only in the frontends' logs (an outside check)
        lines += ["", f"frontends refused {full:g} request(s) over the last "
                      f"{cur.at - prev.at:.1f} s: /dev/shm is full (`df /dev/shm`; others filled "
                      "it: free it, or give it more room)"]
    # what a drain or a stuck worker holds (status had no such figure: a noted gap)
    inflight = in_flight(cur)
    now = "" if inflight is None else f"{inflight} in flight now"
    if prev is not None:
        rates = _request_rates(cur, prev)
        each = ", ".join(f"{m} {_num(r)}" for m, r in rates["by_model"].items()) + "; " \
            if len(rates["by_model"]) > 1 else ""
        if rates["failed"]:
            each += f"{_num(rates['failed'])} of them not answered 200; "
        lines += ["", f"inference requests/s: {_num(rates['total'])} ({each}over the last "
                      f"{cur.at - prev.at:.1f} s){'; ' * bool(now)}{now}"]
    elif now:
        lines += ["", f"inference requests: {now}"]
    return "\n".join(lines)


def in_flight(cur: Sample) -> int | None:
    """Inference requests the frontends hold now (admitted, not yet answered), all together;
    None without a scrape."""
    return _int(cur.total("shmserve_frontend_inflight_requests"))


def snapshot(cur: Sample, prev: Sample | None, about: dict | None = None) -> dict:
    """What `render` shows, as numbers (`shmserve status --json`): bytes and counts as
    integers, seconds and rates unformatted, null where unknown; the rates need `prev`.
    `state` is a word (ready, degraded, loading, unavailable, failing, not_ready, starting,
    no_answer, nginx_only), `state_text` the table's line; `ready` is GET /ready's body;
    `about` (the version, URL and run directory) goes first."""
    out = {**(about or {}), "state": _state_word(cur), "state_text": _state(cur),
           "ready_code": cur.ready_code, "ready": cur.ready,
           "processes": processes_of(cur), "workers": workers_of(cur, prev),
           "inference_requests_in_flight": in_flight(cur)}
    if cur.direct:
        out["figures_from"] = "frontend"
    if prev is not None:
        out["inference_requests_per_s"] = _request_rates(cur, prev)
        out["over_s"] = round(cur.at - prev.at, 3)
    return out


def _state_word(cur: Sample) -> str:
    word = cur.ready.get("status")
    if cur.ready_code == 200:
        # /ready is one frontend's view of the workers: a frontend stopped is seen here only
        # (status said ready with one of two stopped: an outside check)
        return "degraded" if word == "degraded" or _frontends_down(cur) else "ready"
    if cur.ready_code == 503:
        return word if word in ("loading", "unavailable", "failing") else "not_ready"
    # nginx or every frontend stopped by hand is not starting, however young the rest is
    # (`ctl stop frontends:*` within STARTING_S of nginx's start read "starting ... `up
    # --wait` waits for it", and --json a second later "nginx_only": an outside check)
    if not _stopped_by_hand(cur) and any(
            p["statename"] == "STARTING" or (p["name"] == "nginx" and p["statename"] == "RUNNING"
                                             and p.get("start")
                                             and p["now"] - p["start"] < STARTING_S)
            for p in cur.processes if p["name"] == "nginx" or p["name"].startswith("frontend-")):
        # just after `up`: "stuck or gone" misled (an outside check); nginx's program is
        # RUNNING while it waits for a frontend's socket before it starts nginx itself
        return "starting"
    return "no_answer" if cur.ready_code is None else "nginx_only"


STARTING_S = 10  # nginx's program up this long and not answering is not just starting

# Each state word's line in the table's title.
_STATE_TEXT = {
    "ready": "ready",
    "degraded": "degraded (every model is served, not every worker is ready)",
    "loading": "loading (not every worker has loaded its models yet)",
    "unavailable": "unavailable (some model has no ready worker)",
    "failing": "failing (a worker's models fail to load: see below, and its log)",
    "not_ready": "not ready",
    "starting": "starting (nginx or a frontend is starting: `shmserve up --wait` waits for it)",
    "no_answer": "no answer through nginx (nginx, or every frontend, is stuck or gone: see the "
                 "table)",
    "nginx_only": "nginx answers {code}: no frontend answered it",
}


def _stopped_by_hand(cur: Sample, workers: bool = False) -> list[str]:
    """The programs in supervisord's STOPPED state (a stop asked for, not a crash) that keep
    requests from an answer: nginx, or every frontend; with `workers`, the workers stopped
    (state unavailable)."""
    stopped = sorted(p["name"] for p in cur.processes if p["statename"] == "STOPPED")
    if workers:
        return [name for name in stopped if name.startswith("worker-")]
    frontends = {p["name"] for p in cur.processes if p["name"].startswith("frontend-")}
    if "nginx" in stopped or (frontends and frontends <= set(stopped)):
        return [name for name in stopped if name == "nginx" or name in frontends]
    return []


def _frontends_down(cur: Sample) -> list[str]:
    """Frontends supervisord does not run, or that are stopped (SIGSTOP) while it says so."""
    return sorted(p["name"] for p in cur.processes if p["name"].startswith("frontend-") and (
        p["statename"] != "RUNNING" or (p.get("pid") and _stopped(p["pid"]))))


def _state(cur: Sample) -> str:
    word = _state_word(cur)
    down = _frontends_down(cur) if word == "degraded" else []
    apart = sorted({f"worker {w.get('worker')}" for w in cur.ready.get("workers", [])
                    if w.get("diverged")}) if word == "degraded" else []
    text = (f"degraded (every model is served; not serving: {', '.join(down)})" if down
            # every worker ready, one serving apart from the run state: "not every worker is
            # ready" was wrong, and nothing named it (an outside check)
            else f"degraded (every model is served; {', '.join(apart)} serving apart from the "
                 "run state)" if apart and all(w.get("ready") for w in
                                               cur.ready.get("workers", []))
            else _STATE_TEXT[word].format(code=cur.ready_code))
    if word in ("no_answer", "nginx_only", "unavailable") and (
            stopped := _stopped_by_hand(cur, workers=word == "unavailable")):
        # `supervisorctl stop nginx` (or `stop all`) read "stuck or gone", every worker
        # stopped "some model has no ready worker": they were stopped, and nothing said how
        # to start them again (an outside check)
        head = {"no_answer": "no answer through nginx", "unavailable": _STATE_TEXT[word]}.get(
            word, f"nginx answers {cur.ready_code}")
        # one a restart killed part way left stopped: the next restart of its group starts it
        left = [name for name in stopped if name in cur.stopped_by_restart]
        by_hand = [name for name in stopped if name not in left]
        text = f"{head}: " + "; ".join(
            ([f"stopped (supervisorctl stop): {', '.join(by_hand)}"] if by_hand else [])
            + ([f"stopped by a restart that did not finish: {', '.join(left)}"] if left
               else []))
        group = "workers" if left and left[0].startswith("worker-") else "frontends"
        text += ("; `shmserve ctl start all` starts them again" if by_hand else
                 f"; `shmserve restart {group}` starts them again")
    if not cur.direct:
        return text
    # nginx refused this command's /metrics (mutual TLS without nginx.tls_client_certificate,
    # an outside check: the line did not say why the figures came from a frontend)
    refused = (f" (nginx answered /metrics {cur.nginx_metrics})"
               if cur.nginx_metrics not in (None, 200) else "")
    return text + f"; the figures below are a frontend's, read from its socket{refused}"


def _request_rates(cur: Sample, prev: Sample) -> dict:
    """Inference requests answered a second, whatever their status, by model, and those of
    them not answered 200 (`failed`). It counted the 200s alone (the stages' "total" series):
    under a flood of 504s it read 0.0 (an outside check)."""
    name = "shmserve_inference_requests_total"
    models = sorted({value for labels in cur.metrics.get(name, {})
                     for key, value in labels if key == "model"})
    total, ok = _rate(cur, prev, name), _rate(cur, prev, name, status="200")
    rates = {m: _rate(cur, prev, name, model=m) for m in models}
    return {"total": total,
            # those asked in the window: a model apply removed kept its series, listed at 0.0
            # (an outside check)
            "by_model": {m: rate for m, rate in rates.items() if rate},
            "failed": None if total is None else max(0.0, total - (ok or 0.0))}


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger): frozen while supervisord says
    RUNNING (frontends.hung_kill_s, workers.hung_kill_s)."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED,
                                                psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


FDS_NEAR = 0.9  # of a process's open-files limit: `status` says so


def processes_of(cur: Sample) -> list[dict]:
    rows = []
    for p in sorted(cur.processes, key=lambda p: p["name"]):
        up = p["now"] - p["start"] if p.get("pid") and p.get("start") else None
        state = p["statename"]
        if state == "RUNNING" and p.get("pid") and _stopped(p["pid"]):
            state = "RUNNING:stopped"  # supervisord cannot tell; a hung kill is coming
        rss = cur.total("shmserve_process_resident_memory_bytes", program=p["name"])
        fds = (cur.total("shmserve_process_open_fds", program=p["name"]),
               cur.total("shmserve_process_max_fds", program=p["name"]))
        if None in fds:  # no scrape (every frontend out of descriptors, say): read here, as
            fds = processes.open_files(None, [p]).get(p["name"], fds)  # RSS is (a re-check)
        rows.append({"name": p["name"], "state": state, "pid": p.get("pid") or None,
                     "uptime_s": up, "rss_bytes": _int(rss if rss is not None else
                                                       _resident(p.get("pid"))),
                     "open_fds": _int(fds[0]), "max_fds": _int(fds[1])})
    rss = cur.total("shmserve_process_resident_memory_bytes", program="supervisord")
    if rss is not None or cur.supervisord_pid:
        rows.append({"name": "supervisord", "state": "RUNNING", "pid": cur.supervisord_pid,
                     "uptime_s": _uptime(cur.supervisord_pid),
                     "rss_bytes": _int(rss if rss is not None else
                                       _resident(cur.supervisord_pid, children=False))})
    return rows


def _resident(pid: int | None, children: bool = True) -> int | None:
    """A process's resident memory read here, with its children's (as the metric counts it):
    for when no frontend answered /metrics (every one stopped: the column was empty, an
    outside check). The programs are this machine's: status reads the local run directory."""
    try:
        proc = psutil.Process(pid) if pid else None
        if proc is None:
            return None
        members = [proc, *proc.children(recursive=True)] if children else [proc]
        return sum(m.memory_info().rss for m in members)
    except psutil.Error:
        return None


def _uptime(pid: int | None) -> int | None:
    """Whole seconds, as supervisord gives its programs'."""
    try:
        return max(0, int(time.time() - psutil.Process(pid).create_time())) if pid else None
    except psutil.Error:
        return None


def workers_of(cur: Sample, prev: Sample | None) -> list[dict]:
    rows = []
    for w in cur.ready.get("workers", []):
        i = str(w.get("worker"))
        queue = cur.total("shmserve_worker_queue_depth", worker=i)
        texts = _rate(cur, prev, "shmserve_batch_texts_sum", worker=i)
        batches = _rate(cur, prev, "shmserve_batch_texts_count", worker=i)
        real = _delta(cur, prev, "shmserve_batch_tokens_sum", worker=i)
        padded = _delta(cur, prev, "shmserve_batch_padded_tokens_total", worker=i)
        rows.append({
            "worker": w.get("worker"), "device": w.get("device"),
            "configured_device": w.get("configured_device"),
            "ready": bool(w.get("ready")), "alive": bool(w.get("alive")),
            "failed_loads": int(w.get("failed_loads") or 0), "load_error": w.get("load_error"),
            # the models it serves apart from the run state (GET /ready's, /admin/models)
            "diverged": list(w.get("diverged") or []),
            # the models it could not load while it serves its others (GET /ready's)
            "unloaded": list(w.get("unloaded") or []),
            "queued_texts": _int(queue if queue is not None else w.get("queued_texts")),
            "texts_per_s": texts, "batches_per_s": batches,
            "texts_per_batch": texts / batches if texts is not None and batches else None,
            "padding": padded / real if real and padded is not None else None,
            "device_allocated_bytes": _int(cur.total(
                "shmserve_worker_device_allocated_bytes", worker=i)),
            "device_reserved_bytes": _int(cur.total("shmserve_worker_device_reserved_bytes",
                                                    worker=i)),
            "fragmentation": cur.total("shmserve_worker_device_fragmentation_ratio", worker=i),
            "rss_bytes": _int(cur.total("shmserve_process_resident_memory_bytes",
                                        program=f"worker-{i}")),
        })
    return rows


def _delta(cur: Sample, prev: Sample | None, name: str, **labels: str) -> float | None:
    if prev is None:
        return None
    now, before = cur.total(name, **labels), prev.total(name, **labels)
    if now is None:
        return None
    return max(0.0, now - (before or 0.0))  # a reset (restart) reads as no progress


def _rate(cur: Sample, prev: Sample | None, name: str, **labels: str) -> float | None:
    delta = _delta(cur, prev, name, **labels)
    return None if delta is None or cur.at <= prev.at else delta / (cur.at - prev.at)


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return "-"  # not reached


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


def run(take_sample: Callable[[], Sample], title: str, out: TextIO, watch: float | None,
        count: int | None, first_gap: float = 1.0, as_json: bool = False,
        about: dict | None = None) -> Sample:
    """Print one table (two samples `first_gap` apart, for rates), or with `watch` refresh
    every `watch` seconds until `count` frames (None: until interrupted). Returns the last.
    `as_json`: each frame is one line of JSON (`snapshot`), never a cleared screen."""
    prev = take_sample()
    time.sleep(first_gap if watch is None else min(first_gap, watch))
    frames = 0
    while True:
        cur = take_sample()
        if as_json:
            out.write(json.dumps(snapshot(cur, prev, about)) + "\n")
        else:
            if watch is not None and out.isatty():
                out.write("\x1b[H\x1b[2J")  # clear the screen: a live view
            elif frames:
                out.write("\n")
            out.write(render(cur, prev, title) + "\n")
        out.flush()
        frames += 1
        if watch is None or (count is not None and frames >= count):
            return cur
        prev = cur
        time.sleep(watch)
