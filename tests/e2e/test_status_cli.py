"""`shmserve status` against a real stack of two frontends and one CPU worker (the fixture of
test_observability.py, one stack a module), and what a killed process leaves behind in the
metrics (nothing live)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

from shmserve.config import REPO_ROOT
from tests.e2e import test_observability as observed
from tests.e2e.test_observability import log_lines, scrape, total
from tests.stack import Stack

stack = observed.stack  # the fixture: a stack of this module's own


def status_cli(stack: Stack, *args: str):
    return subprocess.run([sys.executable, "-m", "shmserve.cli", "status", *args, "--config",
                           str(stack.config_file)], cwd=REPO_ROOT, env=stack.env,
                          capture_output=True, text=True, timeout=60)


def test_status_shows_processes_and_workers(stack):
    done = status_cli(stack)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert ": ready" in out.splitlines()[0]
    for program in ("worker-0", "frontend-0", "frontend-1", "nginx", "reaper", "supervisord"):
        assert re.search(rf"^{program}\s+RUNNING\s", out, re.M), out
    row = re.search(r"^0\s+cpu\s+yes\s+\d+\s", out, re.M)
    assert row, out
    # nothing asked of it: the frontends hold no request (their gauge, through nginx)
    assert re.search(r"^inference requests/s: .*; 0 in flight now$", out, re.M), out
    watched = status_cli(stack, "--watch", "0.2", "--count", "2")
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout.count("PROGRAM") == 2
    as_json = status_cli(stack, "--json", "--watch", "0.2", "--count", "2")
    assert as_json.returncode == 0, as_json.stderr
    frames = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert len(frames) == 2 and all(f["state"] == "ready" for f in frames)
    assert {p["name"] for p in frames[-1]["processes"]} >= {"worker-0", "nginx", "reaper"}
    (sup,) = [p for p in frames[-1]["processes"] if p["name"] == "supervisord"]
    assert sup["pid"] == int((stack.run_dir / "supervisord.pid").read_text()), sup
    assert sup["uptime_s"] >= 1 and sup["rss_bytes"] > 0
    assert frames[-1]["workers"][0]["ready"] is True and frames[-1]["url"] == stack.url
    assert frames[-1]["inference_requests_in_flight"] == 0


def test_a_frontend_at_its_open_files_limit_is_named_and_scrapes_go_on(stack):
    """A frontend out of file descriptors closed the connections it could not take, and
    nothing said so: `status` ready, scrapes through it a 500 or a partial exposition with
    every worker not ready (an outside check). Now each program's open descriptors and limit
    are metrics, `status` names a program near its limit, and a scrape the frontend cannot
    read is a 503 that nginx sends on to another frontend."""
    import socket
    import time

    import psutil

    procs = [psutil.Process(stack.pid(f"frontends:frontend-{i}")) for i in range(2)]
    soft, hard = procs[0].rlimit(psutil.RLIMIT_NOFILE)
    held = []

    def crowd(index: int) -> int:
        proc = procs[index]
        limit = proc.num_fds() + 2
        proc.rlimit(psutil.RLIMIT_NOFILE, (limit, hard))
        for _ in range(20):  # connections straight to it take its last descriptors
            held.append(socket.socket(socket.AF_UNIX))
            held[-1].connect(str(stack.run_dir / "sockets" / f"frontend-{index}.sock"))
        deadline = time.monotonic() + 10
        while proc.num_fds() < limit:
            assert time.monotonic() < deadline, (proc.num_fds(), limit)
            time.sleep(0.1)
        return limit
    try:
        limit = crowd(0)
        assert [stack.get("/metrics")[0] for _ in range(6)] == [200] * 6
        samples = scrape(stack)
        assert total(samples, "shmserve_process_max_fds", program="frontend-0") == limit
        assert total(samples, "shmserve_process_open_fds", program="frontend-0") >= limit - 1
        assert total(samples, "shmserve_process_max_fds", program="frontend-1") == soft
        done = status_cli(stack)
        assert re.search(rf"^frontend-0: \d+ of its {limit} file descriptors open", done.stdout,
                         re.M), done.stdout
        assert "frontend-1:" not in done.stdout
        # Both: no scrape answers (503 each), and status reads the figures itself, as it
        # reads memory (a re-check: it said nothing)
        limit1 = crowd(1)
        done = status_cli(stack)
        for index, most in enumerate((limit, limit1)):
            assert re.search(rf"^frontend-{index}: \d+ of its {most} file descriptors open",
                             done.stdout, re.M), done.stdout
    finally:
        for sock in held:
            sock.close()
        for proc in procs:
            proc.rlimit(psutil.RLIMIT_NOFILE, (soft, hard))


def test_status_with_nginx_stopped_still_shows_memory_and_workers(stack):
    """It read /metrics and /ready through nginx only: with nginx stopped, no RSS and no worker
    rows (an outside check)."""
    ctl = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "shmserve.cli", "ctl", *a, "--config", str(stack.config_file)],
        cwd=REPO_ROOT, env=stack.env, capture_output=True, text=True, timeout=60)
    assert ctl("stop", "nginx").returncode == 0
    try:
        done = status_cli(stack, "--json")
        frame = json.loads(done.stdout)
        assert done.returncode == 1 and frame["state"] == "no_answer", done.stdout
        assert frame["figures_from"] == "frontend"
        assert frame["workers"][0]["ready"] is True
        rss = {p["name"]: p["rss_bytes"] for p in frame["processes"]}
        assert rss["worker-0"] > 0 and rss["frontend-0"] > 0, rss
        shown = status_cli(stack).stdout
        assert "the figures below are a frontend's" in shown
        # stopped by hand, said so with how to start it, not "stuck or gone" (an outside check)
        assert "no answer through nginx: stopped (supervisorctl stop): nginx; `shmserve ctl " \
            "start all` starts them again" in shown.splitlines()[0], shown
    finally:
        assert ctl("start", "nginx").returncode == 0
    assert status_cli(stack).returncode == 0


def test_status_piped_to_head_exits_quietly(stack):
    cmd = (f"{sys.executable} -m shmserve.cli status --watch 0.1 --config "
           f"{stack.config_file} | head -n 1")
    done = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=REPO_ROOT,
                          env=stack.env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and len(done.stdout.splitlines()) == 1


def test_killed_processes_leave_no_live_gauges(stack):
    """Last in this module: it stops and kills processes."""
    metrics_dir = stack.run_dir / "metrics"
    # A stopped worker reads 0, not nothing: its series vanished with its live gauge file, so
    # an alert on shmserve_worker_ready == 0 never fired (an outside check).
    seen = "shmserve_worker_restarts_seen_total"
    first = {f: total(scrape(stack), seen, frontend=f, worker="0") for f in ("0", "1")}
    stack.ctl("stop", "workers:worker-0")
    stack.wait_until(lambda: [(l["worker"], v) for l, v in scrape(stack).get(
        "shmserve_worker_ready", [])] == [("0", 0.0)], 30, "worker 0 ready at 0 while stopped")
    stack.ctl("start", "workers:worker-0")
    stack.wait_until(lambda: [v for _, v in scrape(stack)["shmserve_worker_ready"]] == [1.0],
                     120, "worker 0 serving again")
    # both frontends have counted that restart before the counts below are taken
    stack.wait_until(lambda: all(total(scrape(stack), seen, frontend=f, worker="0") ==
                                 first[f] + 1 for f in first), 30, "the start seen")
    for _ in range(4):  # batches counted by the worker about to be killed (one worker)
        assert stack.post_json("/predict", {"texts": ["before the kill"]})[0] == 200
    before = scrape(stack)
    groups = {"worker": "workers:worker-0", "frontend": "frontends:frontend-1"}
    old = {p: stack.pid(group) for p, group in groups.items()}
    for pid in old.values():
        assert list(metrics_dir.glob(f"gauge_live*_{pid}.db"))
        os.kill(pid, signal.SIGKILL)
    new = {}

    def restarted():
        for p, group in groups.items():
            if (pid := stack.pid(group)) in (0, old[p]):
                return False
            new[p] = pid
        return True
    stack.wait_until(restarted, 60, "supervisord to restart both")
    stack.wait_until(lambda: not any(list(metrics_dir.glob(f"gauge_live*_{pid}.db"))
                                     for pid in old.values()), 30, "the reaper")
    # Counters and histograms of the dead processes stay, merged into the archive files (every
    # scrape read every file a process ever wrote: a crash loop's thousands took scrapes past
    # nginx's timeout, an outside check); nothing counted is lost (below).
    stack.wait_until(lambda: not any(list(metrics_dir.glob(f"{kind}_{pid}.db"))
                                     for pid in old.values()
                                     for kind in ("counter", "histogram")), 30, "the merge")
    assert (metrics_dir / "counter_archive.db").exists()
    assert (metrics_dir / "histogram_archive.db").exists()

    def new_worker_ready():
        return any(line.get("message") == "worker.ready" and line["pid"] == new["worker"]
                   for line in log_lines(stack, "worker-0"))
    stack.wait_until(new_worker_ready, 120, "the new worker to load")
    stack.wait_until(lambda: stack.get("/ready")[0] == 200, 30, "GET /ready")
    after = scrape(stack)
    assert [v for _, v in after["shmserve_worker_ready"]] == [1.0]  # one worker, once
    assert len(after["shmserve_worker_queue_depth"]) == 1
    assert len(after["shmserve_model_info"]) == 1
    assert total(after, "shmserve_frontend_inflight_requests") == 0
    for counted in ("shmserve_requests_total", "shmserve_batch_texts_count",
                    "shmserve_request_duration_seconds_count"):
        assert total(after, counted) >= total(before, counted) > 0, counted
    # frontend-0 saw worker-0 come back with a new pid; the new frontend-1 never knew the old
    # (both saw the stop and start above).
    stack.wait_until(lambda: total(scrape(stack), seen, frontend="0", worker="0") == total(
        before, seen, frontend="0", worker="0") + 1, 30, "the restart seen")
    assert total(scrape(stack), seen, frontend="1") == total(before, seen, frontend="1")
    # The reaper counts both kills as unexpected exits, by program.
    exits = scrape(stack)
    for program in ("worker-0", "frontend-1"):
        assert total(exits, "shmserve_process_exits_total", program=program,
                     expected="false") == 1, program
    assert stack.post_json("/predict", {"texts": ["after the restart"]})[0] == 200
    # A process that dies while starting (before startsecs) gets BACKOFF, not EXITED: it
    # counts too (it did not: an outside check counted 4 of 5 crashes).
    from shmserve import config, processes

    cfg = config.load_resolved(str(stack.run_dir / "config.json"))
    with processes.supervisor(cfg) as proxy:
        proxy.supervisor.stopProcess("frontends:frontend-1")
        proxy.supervisor.startProcess("frontends:frontend-1", False)
        os.kill(proxy.supervisor.getProcessInfo("frontends:frontend-1")["pid"], signal.SIGKILL)
    stack.wait_until(lambda: total(scrape(stack), "shmserve_process_exits_total",
                                   program="frontend-1", expected="false") == 2, 30,
                     "the crash while starting counted")
