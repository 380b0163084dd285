"""Operating a running deployment with the CLI: rolling restarts that lose no request, a port
another deployment holds, commands that find the deployment as it was started (bringing one
up and down: test_updown)."""

import collections
import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import tiny_overrides
from tests.e2e.conftest import two_of_each_stack
from tests.load import Load
from tests.stack import Stack, free_port


class Traffic(Load):
    """Two closed-loop clients posting one text each; every outcome is its status ("200", an
    error status, or "conn:<error>" when nginx gave no answer)."""

    def __init__(self, stack: Stack) -> None:
        super().__init__(stack, clients=2)

    def body(self, client: int, n: int) -> bytes:
        return json.dumps({"texts": [f"rolling restart {client} {n}"]}).encode()


@pytest.fixture(scope="module")
def shared(tmp_path_factory, tiny_model):
    """Two of each (conftest.two_of_each_stack), for the tests of this module that leave them
    so: each restarts or signals programs, and none changes the config."""
    s = two_of_each_stack(tmp_path_factory.mktemp("operations"), tiny_model)
    s.up()
    yield s
    s.down()


@pytest.fixture
def stack(shared):
    """The module's stack as a test begins: every program serving, its logs read from here
    (Stack.begin_test)."""
    shared.wait_until(shared.all_ready, 90, "every frontend and worker ready")
    shared.begin_test()
    return shared


def triton_stats(stack: Stack) -> dict:
    """The tiny model's statistics in Triton's form (GET /v2/models/stats)."""
    status, _, body = stack.get("/v2/models/tiny/stats")
    assert status == 200, body
    [stat] = json.loads(body)["model_stats"]
    return stat


def test_rolling_restarts_answer_every_request(stack):
    programs = ["workers:worker-0", "workers:worker-1", "frontends:frontend-0",
                "frontends:frontend-1"]
    before = {p: stack.pid(p) for p in programs}
    nginx_before = stack.pid("nginx")
    counted = triton_stats(stack)
    probes, probing = [], threading.Event()

    def probe() -> None:  # a readiness probe, as a load balancer's, all along
        while not probing.is_set():
            probes.append(stack.get("/ready")[0])
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    with Traffic(stack) as traffic:
        prober.start()
        time.sleep(1)
        for group in ("workers", "frontends", "nginx"):
            done = stack.cli("restart", group, timeout=300)
            assert done.returncode == 0, done.stderr
            assert "warning" not in done.stderr  # two of each: no gap to warn of
        time.sleep(1)
        probing.set()
        prober.join(30)
    # Every probe passed: a restarted frontend's first /ready, before it had heard a
    # heartbeat, said "loading" (503), one per frontend (an outside check).
    assert len(probes) > 50 and set(probes) == {200}, collections.Counter(probes)
    after = {p: stack.pid(p) for p in programs}
    assert all(after[p] not in (0, before[p]) for p in programs), (before, after)
    assert stack.pid("nginx") == nginx_before  # reloaded in place, not restarted
    failed = [s for s in traffic.outcomes if s != "200"]
    assert len(traffic.outcomes) > 50 and not failed, (len(traffic.outcomes), failed[:5])
    # Triton's statistics kept every restarted process's counts: each answer counted once
    now = stack.settled(lambda: triton_stats(stack), lambda now: now["inference_count"] - counted[
        "inference_count"] >= len(traffic.outcomes))  # (Stack.settled: the last may lag)
    assert now["inference_count"] - counted["inference_count"] == len(traffic.outcomes)
    assert now["inference_stats"]["success"]["count"] - counted["inference_stats"]["success"][
        "count"] == len(traffic.outcomes)
    assert now["last_inference"] > counted["last_inference"]
    # A restarting frontend refuses nginx's connects (an error line); a missing socket file
    # was logged at crit, which alerting on nginx's crit lines would page for at every restart.
    crit = [line for line in stack.log("nginx").splitlines() if "[crit]" in line]
    assert not crit, crit[:3]
    # Each stopping worker said so last, after its answers, and both frontends read it: none
    # was taken for lost, and nothing it held was computed twice (a worker that exited right
    # after answering lost answers to ZeroMQ: a device error's 500 came back 503).
    lines = [line for i in (0, 1) for line in stack.log_lines(f"frontend-{i}")]
    closed = sorted(line["worker"] for line in lines
                    if line["message"] == "frontend.worker_closed")
    assert closed == [0, 0, 1, 1], closed
    assert not [line for line in lines if line["message"] == "frontend.worker_lost"]


def test_restart_of_one_program_waits_until_it_is_ready(stack):
    before = stack.pid("workers:worker-1")
    done = stack.cli("restart", "worker-1")
    assert "worker-1 ready" in done.stdout
    status, _, body = stack.get("/ready")
    assert status == 200
    after = stack.pid("workers:worker-1")
    assert after != before
    assert b'"pid": %d' % after in body or b'"pid":%d' % after in body
    # All at once: back when the command returns, every worker under its new pid
    pids = [stack.pid(f"workers:worker-{i}") for i in (0, 1)]
    done = stack.cli("restart", "workers", "--all-at-once")
    assert "worker-0 ready" in done.stdout and "worker-1 ready" in done.stdout, done.stdout
    status, _, body = stack.get("/ready")
    workers = json.loads(body)["workers"]
    assert status == 200 and all(w["ready"] for w in workers), body
    assert {w["pid"] for w in workers}.isdisjoint(pids)
    unknown = stack.cli("restart", "worker-7", check=False)
    assert unknown.returncode == 2 and "worker-0, worker-1" in unknown.stderr
    unknown = stack.cli("restart", "foo", check=False)  # not supervisorctl's error, twice, 1
    assert unknown.returncode == 2, unknown.stdout + unknown.stderr
    assert unknown.stderr.count("foo") == 1 and "no group or program 'foo'" in unknown.stderr
    assert "frontend-0" in unknown.stderr and not unknown.stdout
    _restart_nginx_returns_once_its_old_workers_are_done(stack)


def _restart_nginx_returns_once_its_old_workers_are_done(stack: Stack) -> None:
    """`restart nginx` returns once nginx's old workers have finished their requests and
    exited, so what follows meets the new configuration only (it returned at the signal: an
    outside check saw the old gzip setting, and the old port, answer after it returned). A
    request whose body arrives slowly holds an old worker through the reload; it is answered."""
    body = json.dumps({"input": ["held through a reload"]}).encode()
    with socket.create_connection(("127.0.0.1", stack.port), timeout=30) as conn:
        conn.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body[:10])
        time.sleep(0.3)  # nginx has it
        returned = []
        reload = threading.Thread(target=lambda: returned.append(
            (stack.cli("restart", "nginx"), time.monotonic())))
        reload.start()
        time.sleep(2.0)
        assert not returned, returned[0][0].stdout  # still waiting for the held request
        sent = time.monotonic()
        conn.sendall(body[10:])
        answer = conn.recv(65536)
        reload.join(30)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    done, at = returned[0]
    assert at > sent and "nginx reloaded its configuration" in done.stdout, done.stdout


def test_commands_use_the_config_the_deployment_started_with(stack):
    stack.env["SHMSERVE__SERVER__PORT"] = str(free_port())  # a later shell, other settings
    done = stack.cli("status", check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"127.0.0.1:{stack.port}" in done.stdout
    # restart keeps the running config, and says what differs and how to apply it.
    stack.env["SHMSERVE__FRONTENDS__COUNT"] = "3"
    done = stack.cli("restart", "frontend-0", check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "frontends.count: 2 -> 3" in done.stderr and "server.port" in done.stderr
    assert "`shmserve apply`" in done.stderr
    assert "frontend-2" not in stack.ctl("status")  # still two


def test_up_on_the_port_another_deployment_holds_names_that_deployment(stack, tmp_path,
                                                                      tiny_model):
    """Another deployment (another checkout's, or this one's under another server.run_dir) on
    the port: "in use by another process" left a user looking for which (an outside check)."""
    other = Stack(tmp_path / "other", tiny_overrides(tiny_model))
    tree = yaml.safe_load(other.config_file.read_text())
    tree["server"]["port"] = stack.port
    other.config_file.write_text(yaml.safe_dump(tree))
    done = other.cli("up", check=False, timeout=90)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"127.0.0.1:{stack.port} is in use by the nginx of another shmserve deployment " \
        f"(run_dir {stack.run_dir}: " in done.stderr, done.stderr
    assert not other.run_dir.exists()


def test_a_hangup_drains_a_program_and_supervisord_starts_it_again(stack):
    """`supervisorctl signal HUP` killed a frontend or worker on the spot ("terminated by
    SIGHUP", an outside check): each drains as at a stop, exits, and is started again, and
    the other of each serves meanwhile."""
    programs = ["frontends:frontend-0", "workers:worker-0"]
    before = {p: stack.pid(p) for p in programs}
    with Traffic(stack) as traffic:
        time.sleep(1)
        for program in programs:
            done = stack.cli("ctl", "signal", "HUP", program)
            assert done.returncode == 0, done.stdout + done.stderr
            stack.wait_until(lambda: stack.pid(program) not in (0, before[program]), 60,
                             f"{program} to be started again")
            stack.wait_until(lambda: stack.get("/ready")[0] == 200
                             and json.loads(stack.get("/ready")[2])["status"] == "ready", 60,
                             "every worker ready again")
        time.sleep(1)
    failed = [s for s in traffic.outcomes if s != "200"]
    assert len(traffic.outcomes) > 20 and not failed, (len(traffic.outcomes), failed[:5])
    supervisord = stack.log("supervisord")
    assert "terminated by SIGHUP" not in supervisord
    for name in ("frontend-0", "worker-0"):
        assert f"exited: {name} (exit status 0; expected)" in supervisord, supervisord[-2000:]


def test_restarted_frontends_arenas_are_unmapped_by_idle_workers(stack):
    """A restarted frontend's old arena stayed mapped in the workers (and its pages held in
    /dev/shm: 241 MB at idle in an outside check) until each worker's next pass: its last
    pass's requests were still referenced. Now it goes within a second of its removal, as the
    README says, with no request after the restart."""
    for i in range(20):
        assert stack.post_json("/predict", {"texts": [f"arena {i}"]})[0] == 200
    workers = [stack.pid(f"workers:worker-{i}") for i in range(2)]

    def gone_arenas() -> list[str]:
        return [line.split()[-2] for pid in workers
                for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                if "/dev/shm/" in line and line.endswith("(deleted)")]
    # (a frontend another test of the module restarted may have left its arena a moment ago)
    stack.wait_until(lambda: not gone_arenas(), 5, f"no old arena mapped: {gone_arenas()}")
    assert stack.cli("restart", "frontends", timeout=300).returncode == 0
    stack.wait_until(lambda: not gone_arenas(), 5, f"the old arenas unmapped: {gone_arenas()}")
    assert [stack.pid(f"workers:worker-{i}") for i in range(2)] == workers  # same processes


def test_a_second_restart_or_apply_meanwhile_is_refused_naming_the_first(stack):
    """Two rolling restarts at once took both frontends down together (502s, both commands
    exiting 0), and a restart beside an apply both workers (an outside check): one command
    that restarts programs at a time, the others refused at once naming it."""
    first: dict = {}
    rolling = threading.Thread(target=lambda: first.update(
        done=stack.cli("restart", "frontends", timeout=300, check=False)))
    lock = stack.run_dir / "operation.lock"
    with Traffic(stack) as traffic:
        rolling.start()
        deadline = time.monotonic() + 10
        while not lock.exists() or "(pid " not in lock.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # the first command is paused while it holds the lock: on a loaded machine it ended
        # before the third command started, which then found nothing to refuse (CI)
        holder = int(re.search(r"\(pid (\d+)\)", lock.read_text())[1])
        os.kill(holder, signal.SIGSTOP)
        try:
            for args in (("restart", "frontends"), ("restart", "worker-0"), ("apply",)):
                second = stack.cli(*args, check=False)
                assert second.returncode == 2, (args, second.stdout, second.stderr)
                assert "`shmserve restart frontends` (pid" in second.stderr and \
                    "is restarting programs of this deployment; wait for it to end" in \
                    second.stderr, (args, second.stderr)
        finally:
            os.kill(holder, signal.SIGCONT)
        rolling.join(300)
        time.sleep(1)
    assert first["done"].returncode == 0, first["done"].stderr
    failed = [s for s in traffic.outcomes if s != "200"]
    assert len(traffic.outcomes) > 50 and not failed, (len(traffic.outcomes), failed[:5])
    assert stack.cli("restart", "worker-0").returncode == 0  # free again


def test_a_restart_killed_between_stop_and_start_leaves_nothing_stopped_for_good(stack):
    """supervisorctl's restart is a stop, then a start: a `shmserve restart workers
    --all-at-once` killed between the two (Ctrl-C, a lost terminal) left every worker STOPPED,
    which the next `shmserve restart workers` took for an operator's stop and left so (exit 0,
    nothing serving). The restart's record (run/restart.json) names them: started again. The
    Ctrl-C (SIGINT to the terminal's process group) shows the command's own message, not
    supervisorctl's KeyboardInterrupt traceback too."""
    import subprocess
    import sys

    from tests.stack import REPO

    # The workers frozen, so their stop lasts until the command is killed: the SIGTERM waits
    frozen = [stack.pid(f"workers:worker-{i}") for i in (0, 1)]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    killed = subprocess.Popen(
        [sys.executable, "-m", "shmserve.cli", "restart", "workers", "--all-at-once",
         "--config", str(stack.config_file)], cwd=REPO, env=stack.env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        # SIGINT as a terminal leaves it: a suite started in the background by a shell without
        # job control runs with it ignored, and so would the command (CI saw that)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        stack.wait_until(lambda: {p["statename"] for p in stack.processes()
                                  if p["group"] == "workers"} == {"STOPPING"}, 60,
                         "the restart's stop under way")
        os.killpg(killed.pid, signal.SIGINT)  # Ctrl-C
        said = killed.communicate(timeout=10)[1]
    finally:
        killed.kill()
        killed.wait(10)
        killed.stderr.close()
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)  # they take the SIGTERM now, and drain
    assert killed.returncode == 130 and "shmserve: interrupted" in said, said
    assert "Traceback" not in said and "KeyboardInterrupt" not in said, said
    stack.wait_until(lambda: {p["statename"] for p in stack.processes()
                              if p["group"] == "workers"} == {"STOPPED"}, 60,
                     "the stop it began to end")
    assert json.loads((stack.run_dir / "restart.json").read_text())["programs"] == [
        "workers:worker-0", "workers:worker-1"]
    shown = stack.cli("status", check=False).stdout  # says so, and what starts them
    assert "stopped by a restart that did not finish: worker-0, worker-1; `shmserve restart " \
        "workers` starts them again" in shown, shown
    done = stack.cli("restart", "workers", timeout=300)
    assert "worker-0, worker-1 were stopped by a restart that did not finish" in done.stdout, \
        done.stdout
    assert "left stopped" not in done.stdout, done.stdout
    assert not (stack.run_dir / "restart.json").exists()
    stack.wait_until(stack.all_ready, 90, "both workers ready again")
    assert stack.post_json("/predict", {"texts": ["served again"]})[0] == 200


def test_cpu_workers_that_fill_the_cores_are_pinned_one_a_core(stack):
    """workers.cpu_affinity auto: two single-thread workers on this 2-core machine each run on
    their own core (beside a busy process, a scheduler moving them served 0.7x the texts/s:
    docs/performance.md);
    where the layout does not fill the cores, no worker is pinned."""
    import os

    from shmserve import cores

    allowed = sorted(os.sched_getaffinity(0))
    for index in range(2):
        pid = stack.pid(f"workers:worker-{index}")
        want = cores.worker_cores(index, 2, 1) or allowed
        # the process's and the threads it started after (torch's, ZeroMQ's, its own)
        threads = [sorted(os.sched_getaffinity(int(t.name)))
                   for t in Path(f"/proc/{pid}/task").iterdir()]
        assert sorted(os.sched_getaffinity(pid)) == want
        assert threads.count(want) >= len(threads) - 1, threads  # the log writer's before it
        pinned = [x["cores"] for x in stack.log_lines(f"worker-{index}", whole=True)
                  if x.get("message") == "worker.pinned" and x["pid"] == pid]
        assert pinned == ([want] if want != allowed else [])


def test_log_reopen_signals_leave_programs_running(stack):
    """`supervisorctl signal USR1` (nginx's "reopen your logs", sent to all in a logrotate
    habit) killed a frontend or worker on the spot, without a drain ("terminated by SIGUSR1;
    not expected", an outside check): they log to supervisord, so there is nothing to reopen,
    and both signals are ignored."""
    programs = ["frontends:frontend-1", "workers:worker-1"]
    before = {p: stack.pid(p) for p in programs}
    for sig in ("USR1", "USR2"):
        for program in programs:
            done = stack.cli("ctl", "signal", sig, program)
            assert done.returncode == 0, done.stdout + done.stderr
    time.sleep(2)
    assert {p: stack.pid(p) for p in programs} == before
    supervisord = stack.log("supervisord")
    assert "terminated by SIGUSR" not in supervisord, supervisord[-2000:]
    status, _, body = stack.get("/ready")
    assert status == 200 and json.loads(body)["status"] == "ready", body
