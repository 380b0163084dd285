"""`shmserve status`'s tables from canned answers: no stack."""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from shmserve import status

PROCESSES = [
    {"name": "worker-0", "statename": "RUNNING", "pid": 101, "start": 1000, "now": 4723},
    {"name": "frontend-0", "statename": "RUNNING", "pid": 102, "start": 1000, "now": 1065},
    {"name": "nginx", "statename": "BACKOFF", "pid": 0, "start": 0, "now": 1065},
]
READY = {"status": "ready", "workers": [
    {"worker": 0, "alive": True, "ready": True, "device": "cuda:NVIDIA H200", "queued_texts": 3},
    {"worker": 1, "alive": True, "ready": False, "device": "loading", "queued_texts": 0}]}


def exposition(texts: float, batches: float, real: float, padded: float) -> str:
    return f"""# HELP shmserve_batch_texts Texts in a batch
# TYPE shmserve_batch_texts histogram
shmserve_batch_texts_bucket{{le="+Inf",model="m",worker="0"}} {batches}
shmserve_batch_texts_count{{model="m",worker="0"}} {batches}
shmserve_batch_texts_sum{{model="m",worker="0"}} {texts}
# HELP shmserve_batch_tokens Real tokens
# TYPE shmserve_batch_tokens histogram
shmserve_batch_tokens_bucket{{le="+Inf",model="m",worker="0"}} {batches}
shmserve_batch_tokens_count{{model="m",worker="0"}} {batches}
shmserve_batch_tokens_sum{{model="m",worker="0"}} {real}
# HELP shmserve_batch_padded_tokens_total Padded
# TYPE shmserve_batch_padded_tokens_total counter
shmserve_batch_padded_tokens_total{{model="m",worker="0"}} {padded}
# HELP shmserve_worker_queue_depth Queue
# TYPE shmserve_worker_queue_depth gauge
shmserve_worker_queue_depth{{worker="0"}} 7.0
# HELP shmserve_worker_device_allocated_bytes A
# TYPE shmserve_worker_device_allocated_bytes gauge
shmserve_worker_device_allocated_bytes{{worker="0"}} 2147483648.0
# HELP shmserve_worker_device_reserved_bytes R
# TYPE shmserve_worker_device_reserved_bytes gauge
shmserve_worker_device_reserved_bytes{{worker="0"}} 3221225472.0
# HELP shmserve_worker_device_fragmentation_ratio F
# TYPE shmserve_worker_device_fragmentation_ratio gauge
shmserve_worker_device_fragmentation_ratio{{worker="0"}} 0.3333
# HELP shmserve_process_resident_memory_bytes RSS
# TYPE shmserve_process_resident_memory_bytes gauge
shmserve_process_resident_memory_bytes{{program="worker-0"}} 1610612736.0
shmserve_process_resident_memory_bytes{{program="frontend-0"}} 104857600.0
shmserve_process_resident_memory_bytes{{program="supervisord"}} 20971520.0
shmserve_process_open_fds{{program="worker-0"}} 41.0
shmserve_process_max_fds{{program="worker-0"}} 1024.0
# HELP shmserve_stage_duration_seconds Stages (of 200s only)
# TYPE shmserve_stage_duration_seconds histogram
shmserve_stage_duration_seconds_count{{model="m",stage="total"}} {batches * 2}
# HELP shmserve_inference_requests_total Inference requests answered
# TYPE shmserve_inference_requests_total counter
shmserve_inference_requests_total{{model="m",priority="0",status="200",variant=""}} {batches * 2}
shmserve_inference_requests_total{{model="m",priority="0",status="504",variant=""}} {batches / 10}
"""


def sample(at: float, texts: float, batches: float, real: float, padded: float,
           ready_code: int = 200) -> status.Sample:
    return status.Sample(at, PROCESSES, ready_code, READY,
                         status.parse_metrics(exposition(texts, batches, real, padded)))


def rows(text: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in text.splitlines() if line.strip()}


def test_tables_show_processes_and_workers_with_rates():
    prev = sample(100.0, texts=1000, batches=100, real=10_000, padded=12_000)
    cur = sample(102.0, texts=1400, batches=120, real=14_000, padded=17_000)
    text = status.render(cur, prev, "shmserve test")
    assert text.splitlines()[0] == "shmserve test: ready"
    table = rows(text)
    assert table["worker-0"][:4] == ["worker-0", "RUNNING", "101", "1:02:03"]
    assert table["worker-0"][4:] == ["1.5", "GiB"]
    assert table["nginx"][:4] == ["nginx", "BACKOFF", "-", "-"]
    assert table["supervisord"][-2:] == ["20.0", "MiB"]
    w0 = text.splitlines()[[l.split()[:1] for l in text.splitlines()].index(["0"])].split()
    # worker, device (two words), ready, queue (metrics win over /ready), texts/s, batches/s,
    # texts/batch, padding, allocated, reserved, fragmentation, rss
    assert w0 == ["0", "cuda:NVIDIA", "H200", "yes", "7", "200.0", "10.0", "20.0", "1.25",
                  "2.0", "GiB", "3.0", "GiB", "0.33", "1.5", "GiB"]
    w1 = [l.split() for l in text.splitlines() if l.startswith("1 ")][0]
    assert w1[:4] == ["1", "loading", "loading", "0"]  # alive, not ready; queue from /ready
    # every status (the 200s alone read 0.0 under a flood of 504s: an outside check)
    assert "inference requests/s: 21.0 (1.0 of them not answered 200; over the last 2.0 s)" \
        in text
    assert "/dev/shm is full" not in text and "file descriptors" not in text
    # A full /dev/shm's refusals (503s a frontend's log alone named: an outside check), and a
    # program near its open-files limit, are said below the tables.
    refused = ("# TYPE shmserve_frontend_refused_total counter\n"
               'shmserve_frontend_refused_total{reason="shm_full"} %d\n'
               'shmserve_process_open_fds{program="worker-0"} 1000.0\n')
    cur = status.Sample(cur.at, PROCESSES, 200, READY, status.parse_metrics(
        exposition(1400, 120, 14_000, 17_000) + refused % 7))
    prev = status.Sample(prev.at, PROCESSES, 200, READY, status.parse_metrics(
        exposition(1000, 100, 10_000, 12_000) + refused % 4))
    text = status.render(cur, prev, "shmserve test")
    assert ("frontends refused 3 request(s) over the last 2.0 s: /dev/shm is full") in text
    assert "worker-0: 1000 of its 1024 file descriptors open" in text


def test_json_holds_the_tables_figures_unformatted():
    """`shmserve status --json`: a line of JSON a frame, for scripts (an operator's outside
    check missed it), with the figures the tables show."""
    prev = sample(100.0, texts=1000, batches=100, real=10_000, padded=12_000)
    cur = sample(102.0, texts=1400, batches=120, real=14_000, padded=17_000)
    snap = json.loads(json.dumps(status.snapshot(cur, prev, {"version": "v"})))
    assert snap["version"] == "v" and list(snap)[0] == "version"
    assert snap["state"] == "ready" and snap["state_text"] == "ready"
    assert snap["ready_code"] == 200 and snap["over_s"] == 2.0
    procs = {p["name"]: p for p in snap["processes"]}
    assert procs["worker-0"] == {"name": "worker-0", "state": "RUNNING", "pid": 101,
                                 "uptime_s": 3723, "rss_bytes": 3 * 2**29,
                                 "open_fds": 41, "max_fds": 1024}
    assert isinstance(procs["worker-0"]["rss_bytes"], int)
    assert procs["nginx"]["pid"] is None and procs["nginx"]["uptime_s"] is None
    # supervisord is not among its own programs: its pid from its pid file, uptime from /proc
    assert procs["supervisord"]["pid"] is None and procs["supervisord"]["rss_bytes"] == 2**20 * 20
    me = status.Sample(cur.at, cur.processes, 200, READY, cur.metrics, supervisord_pid=os.getpid())
    (row,) = [p for p in status.processes_of(me) if p["name"] == "supervisord"]
    assert row["pid"] == os.getpid()
    assert abs(row["uptime_s"] - (time.time() - psutil.Process().create_time())) <= 1.5
    assert re.search(rf"^supervisord\s+RUNNING\s+{os.getpid()}\s+\d", status.render(me, None, "t"),
                     re.M)
    w0 = snap["workers"][0]
    assert (w0["texts_per_s"], w0["batches_per_s"], w0["texts_per_batch"], w0["padding"]) == \
        (200.0, 10.0, 20.0, 1.25)
    assert w0["queued_texts"] == 7 and isinstance(w0["queued_texts"], int)
    assert w0["ready"] is True and w0["alive"] is True
    w1 = snap["workers"][1]
    assert w1["ready"] is False and w1["alive"] is True  # loading
    # A word for scripts beside the table's line, in every state
    for code, word, want in ((200, "degraded", "degraded"), (503, "loading", "loading"),
                             (503, "unavailable", "unavailable"), (503, None, "not_ready"),
                             (None, None, "no_answer"), (502, None, "nginx_only")):
        odd = status.Sample(cur.at, cur.processes, code, {**READY, "status": word}, cur.metrics)
        assert status.snapshot(odd, None)["state"] == want
    # Just after `up`: nginx or a frontend still starting, not "stuck or gone" (an outside check)
    starting = [{**p, "statename": "STARTING"} if p["name"] == "frontend-0" else p
                for p in cur.processes]
    for code in (None, 502):
        early = status.Sample(cur.at, starting, code, {}, cur.metrics)
        assert status.snapshot(early, None)["state"] == "starting"
        assert status.render(early, None, "t").startswith("t: starting (nginx or a frontend")
    # ... or RUNNING for under STARTING_S (nginx's program waits for a frontend's socket)
    for started, want in ((5, "starting"), (60, "no_answer")):
        young = [{**p, "start": p["now"] - started, "statename": "RUNNING"}
                 if p["name"] == "nginx" else
                 {**p, "start": p["now"] - 3600} for p in cur.processes]
        early = status.Sample(cur.at, young, None, {}, cur.metrics)
        assert status.snapshot(early, None)["state"] == want, (started, young)
    # Stopped by hand (`supervisorctl stop nginx`, `stop all`): said so, not "stuck or gone"
    # (an outside check)
    for names in (("nginx",), tuple(p["name"] for p in cur.processes)):
        held = [{**p, "statename": "STOPPED"} if p["name"] in names else
                {**p, "start": p["now"] - 3600} for p in cur.processes]
        quiet = status.Sample(cur.at, held, None, {}, cur.metrics)
        assert status.snapshot(quiet, None)["state"] == "no_answer"
        line = status.render(quiet, None, "t").splitlines()[0]
        assert "stuck or gone" not in line and "stopped (supervisorctl stop): " in line, line
        assert "nginx" in line and "`shmserve ctl start all`" in line, line
    # every worker stopped by hand: "unavailable (some model has no ready worker)" alone
    held = [{**p, "statename": "STOPPED"} if p["name"].startswith("worker-") else p
            for p in cur.processes]
    quiet = status.Sample(cur.at, held, 503, {**READY, "status": "unavailable"}, cur.metrics)
    assert status.snapshot(quiet, None)["state"] == "unavailable"
    line = status.render(quiet, None, "t").splitlines()[0]
    assert line.startswith("t: unavailable (some model has no ready worker): stopped "
                           "(supervisorctl stop): worker-0; `shmserve ctl start "
                           "all`"), line
    # ... stopped by a restart killed between its stop and its start (run/restart.json): said
    # so, with the command that starts it
    quiet = status.Sample(cur.at, held, 503, {**READY, "status": "unavailable"}, cur.metrics,
                          stopped_by_restart=["worker-0"])
    line = status.render(quiet, None, "t").splitlines()[0]
    assert line.startswith("t: unavailable (some model has no ready worker): stopped by a "
                           "restart that did not finish: worker-0; `shmserve restart workers` "
                           "starts them again"), line
    # ... even within STARTING_S of nginx's start (`ctl stop frontends:*` just after `up` or
    # `ctl start nginx`): nothing is starting, "`up --wait` waits for it" misled
    held = [{**p, "statename": "STOPPED"} if p["name"].startswith("frontend-") else
            {**p, "start": p["now"] - 3, "statename": "RUNNING"} for p in cur.processes]
    quiet = status.Sample(cur.at, held, 502, {}, cur.metrics)
    assert status.snapshot(quiet, None)["state"] == "nginx_only"
    line = status.render(quiet, None, "t").splitlines()[0]
    assert "stopped (supervisorctl stop): frontend-" in line and "starting" not in line, line
    assert snap["inference_requests_per_s"] == {"total": 21.0, "by_model": {"m": 21.0},
                                                "failed": 1.0}
    assert "inference_requests_per_s" not in status.snapshot(cur, None)
    out = io.StringIO()
    status.run(lambda: cur, "t", out, watch=0.001, count=2, first_gap=0, as_json=True)
    frames = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(frames) == 2 and frames[0]["processes"] == snap["processes"]


def test_the_request_rate_covers_every_model_and_names_each_when_several():
    # It read "embedding requests/s" for the sum over an embedding, a classification and a
    # rerank model (an outside check).
    def at(t: float, counts: dict[str, float]) -> status.Sample:
        return status.Sample(t, [], 200, {}, {"shmserve_inference_requests_total": {
            frozenset({("model", m), ("status", "200")}): n for m, n in counts.items()}})

    text = status.render(at(3.0, {"e5": 30, "nli": 10, "gone": 4}),
                         at(1.0, {"e5": 10, "nli": 6, "gone": 4}), "t")
    # (a model asked nothing in the window, one apply removed say, is not listed at 0.0)
    assert "inference requests/s: 12.0 (e5 10.0, nli 2.0; over the last 2.0 s)" in text


def test_the_requests_in_flight_are_summed_over_the_frontends():
    """What a drain waits for, or a stuck worker leaves waiting: status had no such figure (a
    noted gap). The frontends' gauge, summed; in the JSON too; none without a scrape."""
    gauge = ("# TYPE shmserve_frontend_inflight_requests gauge\n"
             'shmserve_frontend_inflight_requests{frontend="0"} 5.0\n'
             'shmserve_frontend_inflight_requests{frontend="1"} 7.0\n')

    def at(t: float) -> status.Sample:
        return status.Sample(t, PROCESSES, 200, READY, status.parse_metrics(
            exposition(1000 * t, 100 * t, 1000 * t, 1000 * t) + gauge))

    text = status.render(at(2.0), at(1.0), "t")
    assert "inference requests/s: 210.0 (10.0 of them not answered 200; over the last 1.0 s); " \
        "12 in flight now" in text
    assert "inference requests: 12 in flight now" in status.render(at(2.0), None, "t")
    assert status.snapshot(at(2.0), at(1.0))["inference_requests_in_flight"] == 12
    bare = sample(1.0, 10, 1, 10, 10)  # a scrape without the gauge
    assert status.snapshot(bare, None)["inference_requests_in_flight"] is None
    assert "in flight" not in status.render(bare, None, "t")


def test_first_frame_without_a_previous_sample_has_no_rates():
    text = status.render(sample(1.0, 10, 1, 10, 10, ready_code=None), None, "t")
    assert text.splitlines()[0].startswith("t: no answer through nginx (")
    # nginx up, every frontend down: its own 502 is not silence.
    text = status.render(sample(1.0, 10, 1, 10, 10, ready_code=502), None, "t")
    assert text.splitlines()[0] == "t: nginx answers 502: no frontend answered it"
    w0 = [l.split() for l in text.splitlines() if l.startswith("0 ")][0]
    assert w0[5:9] == ["-", "-", "-", "-"] and "requests/s" not in text


def test_a_restart_resets_counters_without_negative_rates():
    prev = sample(1.0, 1000, 100, 100, 100)
    cur = sample(2.0, 10, 1, 5, 5)
    w0 = [l.split() for l in status.render(cur, prev, "t").splitlines() if l.startswith("0 ")][0]
    assert w0[5:7] == ["0.0", "0.0"]


def test_watch_prints_count_frames_and_returns_the_last():
    clock = itertools.count()
    samples = []

    def take():
        i = next(clock)
        samples.append(sample(float(i), 10 * i, i, 10 * i, 10 * i))
        return samples[-1]
    out = io.StringIO()
    last = status.run(take, "t", out, watch=0.001, count=3, first_gap=0)
    assert out.getvalue().count("PROGRAM") == 3 and last is samples[-1] and len(samples) == 4
    out = io.StringIO()
    status.run(take, "t", out, watch=None, count=None, first_gap=0)
    assert out.getvalue().count("PROGRAM") == 1


def test_a_degraded_deployment_says_so():
    cur = sample(1.0, 10, 1, 10, 10)
    cur = status.Sample(cur.at, cur.processes, 200, {**READY, "status": "degraded"}, cur.metrics)
    assert status.render(cur, None, "t").splitlines()[0] == \
        "t: degraded (every model is served, not every worker is ready)"


def test_a_worker_serving_apart_from_the_run_state_is_named():
    """Every worker ready, worker 1 serving a model apart from the run state (its reloaded
    source deleted, then it restarted): status said "not every worker is ready" and named
    nothing (an outside check)."""
    cur = sample(1.0, 10, 1, 10, 10)
    workers = [{**w, "ready": True, "device": "cpu", "diverged": ["minilm"] if w["worker"]
                else []} for w in READY["workers"]]
    cur = status.Sample(cur.at, cur.processes, 200, {"status": "degraded", "workers": workers},
                        cur.metrics)
    text = status.render(cur, None, "t").splitlines()
    assert text[0] == "t: degraded (every model is served; worker 1 serving apart from the " \
        "run state)"
    assert any(line.startswith("worker 1: serves minilm apart from the run state") for line in text)
    snap = status.snapshot(cur, None)
    assert [w["diverged"] for w in snap["workers"]] == [[], ["minilm"]]


@pytest.mark.parametrize("word,why", [
    ("loading", "loading (not every worker has loaded its models yet)"),
    ("unavailable", "unavailable (some model has no ready worker)"),
    ("failing", "failing (a worker's models fail to load: see below, and its log)")])
def test_a_deployment_not_ready_says_which_way(word, why):
    cur = sample(1.0, 10, 1, 10, 10)
    cur = status.Sample(cur.at, cur.processes, 503, {**READY, "status": word}, cur.metrics)
    assert status.render(cur, None, "t").splitlines()[0] == f"t: {why}"


def test_a_stopped_process_says_so_where_supervisord_says_running():
    """A frozen frontend or worker (SIGSTOP) is RUNNING to supervisord until the hung kill."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        proc.send_signal(signal.SIGSTOP)
        for _ in range(200):  # the stop is asynchronous
            if psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED:
                break
            time.sleep(0.01)
        processes = [{"name": "frontend-0", "statename": "RUNNING", "pid": proc.pid,
                      "start": 1000, "now": 1065}, *PROCESSES[:1]]
        cur = status.Sample(1.0, processes, 200, READY, status.parse_metrics(""))
        table = rows(status.render(cur, None, "t"))
        assert table["frontend-0"][1] == "RUNNING:stopped"
        assert table["worker-0"][1] == "RUNNING"
    finally:
        proc.kill()
        proc.wait()


def test_with_nginx_silent_the_figures_come_from_a_frontend_and_the_state_says_so():
    """With nginx stopped, status showed no memory and no worker rows (an outside check): it
    read /metrics and /ready through nginx only. The state stays nginx's silence."""
    metrics = exposition(texts=10, batches=1, real=10, padded=10).encode()
    asked = []

    def direct(target):
        asked.append(target)
        return 200, (metrics if target == "/metrics" else json.dumps(READY).encode())

    through_nginx = []

    def silent(url):
        through_nginx.append(url)
        return None, b""
    cur = status.take("http://x", silent, lambda: PROCESSES, direct=direct)
    assert asked == ["/metrics", "/ready"] and cur.direct
    # nginx silent on /ready is not asked /metrics too: a stuck nginx cost each its timeout
    assert through_nginx == ["http://x/ready"]
    snap = status.snapshot(cur, None)
    assert snap["state"] == "no_answer" and snap["figures_from"] == "frontend"
    assert [w["worker"] for w in snap["workers"]] == [0, 1]
    assert snap["workers"][0]["queued_texts"] == 7
    assert any(p["rss_bytes"] == 104857600 for p in snap["processes"])
    text = status.render(cur, None, "t")
    assert text.splitlines()[0].endswith("; the figures below are a frontend's, read from its "
                                         "socket")
    # nginx answering: the frontend is not asked, and nothing says it was
    asked.clear()
    cur = status.take("http://x", lambda url: (200, metrics if url.endswith("/metrics") else
                                               json.dumps(READY).encode()),
                      lambda: PROCESSES, direct=direct)
    assert asked == [] and not cur.direct and "figures_from" not in status.snapshot(cur, None)
    # nginx answering /ready but refusing /metrics (mutual TLS, this command presenting no
    # certificate): the line says what nginx answered
    cur = status.take("http://x", lambda url: (403, b"{}") if url.endswith("/metrics") else
                      (200, json.dumps(READY).encode()), lambda: PROCESSES, direct=direct)
    assert cur.direct and status.render(cur, None, "t").splitlines()[0].endswith(
        "; the figures below are a frontend's, read from its socket (nginx answered /metrics "
        "403)")


def test_a_worker_whose_load_fails_shows_as_failing_with_its_error():
    """/ready's worker entries name a failed load's error (README, Reliability): the table
    says failing for that worker, and a line gives the error, which `--json` holds too."""
    cur = sample(1.0, 10, 1, 10, 10)
    workers = [READY["workers"][0], {**READY["workers"][1], "alive": False, "failed_loads": 3,
                                     "load_error": "ModelSourceError: lacks 16 weights",
                                     "device": "loading", "configured_device": "cuda:1"}]
    cur = status.Sample(cur.at, cur.processes, 503, {"status": "failing", "workers": workers},
                        cur.metrics)
    text = status.render(cur, None, "t")
    # the device it is configured for, not its heartbeats' "loading" (an outside check)
    assert rows(text)["1"][1:3] == ["cuda:1", "failing"]
    assert "worker 1: its load failed 3 time(s) in a row (it starts again): ModelSourceError: " \
        "lacks 16 weights" in text.splitlines()
    shown = status.snapshot(cur, None)
    assert shown["state"] == "failing"
    assert [(w["failed_loads"], w["load_error"]) for w in shown["workers"]] == [
        (0, None), (3, "ModelSourceError: lacks 16 weights")]


def test_with_no_frontend_answering_memory_is_read_here():
    """Every frontend stopped, nginx answering 502: the RSS column was empty for every process
    (it came from /metrics alone; an outside check). It is read from the process and its
    children here; a pid no process has stays empty."""
    # Measured once its interpreter is up: read at once, a loaded machine's child was still
    # in its exec (4 KiB resident; a CI run)
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); "
                             "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "up\n"
        processes = [{"name": "nginx", "statename": "RUNNING", "pid": proc.pid,
                      "start": 1000, "now": 1065},
                     {"name": "worker-0", "statename": "RUNNING", "pid": 2 ** 22 + 7,
                      "start": 1000, "now": 1065}]
        cur = status.Sample(1.0, processes, 502, {}, status.parse_metrics(""))
        listed = {p["name"]: p["rss_bytes"] for p in status.processes_of(cur)}
        assert listed["nginx"] > 1 << 20  # a Python process's (it grows as it starts)
        assert listed["worker-0"] is None
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_a_stopped_frontend_makes_the_state_degraded():
    """/ready is one frontend's view of the workers, so a frontend supervisord stopped never
    showed: status said ready with one of two frontends stopped (an outside check)."""
    cur = sample(102.0, texts=1400, batches=120, real=14_000, padded=17_000)
    stopped = [*cur.processes, {"name": "frontend-1", "statename": "STOPPED", "pid": 0,
                                "start": 0, "now": 1065}]
    odd = status.Sample(cur.at, stopped, 200, READY, cur.metrics)
    snap = status.snapshot(odd, None)
    assert snap["state"] == "degraded", snap["state"]
    assert snap["state_text"] == "degraded (every model is served; not serving: frontend-1)"
    assert status.snapshot(cur, None)["state"] == "ready"  # both frontends of it running
