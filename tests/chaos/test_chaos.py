"""Chaos under continuous load through nginx: kill each kind of process in turn and count.

Run alone with `scripts/test -m chaos`; they are part of the default suite too.
"""

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shmserve import config, topology
from tests.conftest import tiny_overrides
from tests.load import Load as ClosedLoop
from tests.stack import Stack

pytestmark = pytest.mark.chaos
SHM = Path("/dev/shm")


class Load(ClosedLoop):
    def __init__(self, stack: Stack, clients: int = 6) -> None:
        super().__init__(stack, clients)

    def body(self, client: int, n: int) -> bytes:
        return f'{{"texts": ["client {client} request {n}", "second text"]}}'.encode()


def kill_and_wait(stack: Stack, program: str, load: Load) -> Counter:
    start = load.mark()
    old = stack.pid(program)
    os.kill(old, signal.SIGKILL)
    stack.wait_until(lambda: stack.pid(program) not in (0, old), 60, f"{program} restart")
    # RUNNING comes startsecs after the start: by then nginxrun has killed the workers the dead
    # master left (they keep answering meanwhile) and the new master listens.
    stack.wait_until(lambda: stack.info(program).get("statename") == "RUNNING", 60,
                     f"{program} RUNNING")
    stack.wait_until(stack.all_ready, 90, "every worker ready after the restart")
    # Keep the load on a little past readiness, so requests of the recovered state count too.
    target = load.mark() + 20
    stack.wait_until(lambda: load.mark() >= target, 60, "requests after recovery")
    return load.since(start)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    s = Stack(tmp_path_factory.mktemp("chaos"), tiny_overrides(
        tiny_model,
        # hung_kill_s: past the 5 s stop of the test that resumes the worker, short enough
        # for the one that does not
        workers={"devices": "cpu", "cpu_workers": 2, "torch_threads": 1, "hung_kill_s": 10},
        frontends={"count": 2, "hung_kill_s": 5}))
    s.up()
    yield s
    s.down()


def test_worker_kill_costs_zero_failed_requests(stack):
    with Load(stack) as load:
        counts = kill_and_wait(stack, "workers:worker-0", load)
    assert set(counts) == {"200"}, counts


class UnevenLoad(Load):
    """Requests of 1-3 texts of 1-60 words: slots of many sizes, so a slot freed too early is
    soon another request's with other offsets."""

    def body(self, client: int, n: int) -> bytes:
        texts = [" ".join(["word"] * (1 + (n * 7 + client * 13 + i * 29) % 60))
                 for i in range(1 + (n + client) % 3)]
        return json.dumps({"texts": texts}).encode()


def test_a_worker_stopped_past_the_heartbeat_timeout_resumes_and_serves_on(stack):
    # SIGSTOP (a stall, a swapped-out process): the frontends take it for dead and retry its
    # requests elsewhere; on SIGCONT it finds those requests' slots still its own (not reused
    # by others), answers the aborts, and serves on: the same process, nothing failed.
    pid = stack.pid("workers:worker-0")
    with UnevenLoad(stack) as load:
        start = load.mark()
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(5)  # past heartbeat_timeout_s (1.5 in configs/test.yaml)
        finally:
            os.kill(pid, signal.SIGCONT)
        stack.wait_until(stack.all_ready, 30, "every worker ready after resuming")
        target = load.mark() + 100
        stack.wait_until(lambda: load.mark() >= target, 60, "requests after resuming")
        counts = load.since(start)
    assert set(counts) == {"200"}, counts
    assert stack.pid("workers:worker-0") == pid  # it did not crash on resuming


def stop_for_good(stack: Stack, program: str, on_stopped=lambda: None) -> Counter:
    """SIGSTOP `program` under load and never SIGCONT it (a hung process: supervisord still sees
    it RUNNING); wait until it is killed and restarted and the stack serves again. The outcomes
    of every request since the stop. `on_stopped` runs while it is stopped."""
    pid = stack.pid(program)
    try:
        with Load(stack) as load:
            start = load.mark()
            os.kill(pid, signal.SIGSTOP)
            on_stopped()
            stack.wait_until(lambda: stack.pid(program) not in (0, pid), 60,
                             f"the stopped {program} to be killed and restarted")
            stack.wait_until(stack.all_ready, 90, "every worker ready after the restart")
            target = load.mark() + 20
            stack.wait_until(lambda: load.mark() >= target, 60, "requests after the restart")
            return load.since(start)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)  # should the test fail before the kill
        except ProcessLookupError:
            pass


def ready_gauges(stack: Stack) -> dict[str, float]:
    _, _, raw = stack.get("/metrics")
    return {s.labels["worker"]: s.value for f in text_string_to_metric_families(raw.decode())
            for s in f.samples if s.name == "shmserve_worker_ready"}


def kills(stack: Stack, logs: list[str], message: str, metric: str) -> tuple[list, float]:
    """The kill log lines in `logs` and the kills counted in /metrics."""
    lines = [line for name in logs for line in stack.log_lines(name)
             if line.get("message") == message]
    _, _, raw = stack.get("/metrics")
    counted = sum(s.value for f in text_string_to_metric_families(raw.decode())
                  for s in f.samples if s.name == metric)
    return lines, counted


def test_a_worker_stopped_for_good_is_killed_and_restarted(stack):
    # The frontends route around it at once ("degraded": the other worker serves); after
    # hung_kill_s of silence one SIGKILLs it, supervisord restarts it, and it serves again.
    pid = stack.pid("workers:worker-0")

    def degraded():
        stack.wait_until(lambda: json.loads(stack.get("/ready")[2])["status"] == "degraded",
                         30, "GET /ready to say degraded")
        assert stack.get("/ready")[0] == 200
        # /ready counts the silence the kill is judged on
        stopped = next(w for w in json.loads(stack.get("/ready")[2])["workers"]
                       if w["worker"] == 0)
        assert stopped["pid"] == pid and stopped["silent_s"] >= 1.0, stopped
        # and so does /metrics, from either frontend (four scrapes in a row), though the
        # stopped worker's own gauge still says 1 (it read 1 until the kill: an outside check)
        stack.wait_until(lambda: all(ready_gauges(stack) == {"0": 0.0, "1": 1.0}
                                     for _ in range(4)), 5, "worker 0 scraped not ready")

    counts = stop_for_good(stack, "workers:worker-0", degraded)
    assert set(counts) == {"200"}, counts
    killed, counted = kills(stack, ["frontend-0", "frontend-1"], "frontend.worker_hung_killed",
                            "shmserve_worker_hung_kills_total")
    assert killed and {line["worker_pid"] for line in killed} == {pid}, killed
    assert 1 <= counted <= 2  # several frontends may both have sent it


def test_a_frontend_stopped_for_good_is_killed_and_its_requests_served_elsewhere(stack):
    # nginx keeps the requests it gave the frontend waiting, and gives it new ones whenever its
    # connection count is the lowest. After frontends.hung_kill_s without its pings the workers
    # SIGKILL it, supervisord restarts it, and nginx sends the requests it held, whose
    # connections drop, to the other frontend.
    pid = stack.pid("frontends:frontend-0")
    counts = stop_for_good(stack, "frontends:frontend-0")
    assert set(counts) == {"200"}, counts
    killed, counted = kills(stack, ["worker-0", "worker-1"], "worker.frontend_hung_killed",
                            "shmserve_frontend_hung_kills_total")
    assert killed and {line["frontend_pid"] for line in killed} == {pid}, killed
    assert all(line["frontend"] == 0 and line["silent_s"] >= 5 for line in killed), killed
    assert 1 <= counted <= 2  # both workers may have sent it


def test_frontend_kill_costs_zero_failed_requests(stack):
    with Load(stack) as load:
        counts = kill_and_wait(stack, "frontends:frontend-0", load)
    assert set(counts) == {"200"}, counts


def test_nginx_kill_every_request_completes_and_service_returns(stack):
    with Load(stack) as load:
        counts = kill_and_wait(stack, "nginx", load)
        after = load.mark()
        target = after + 20
        stack.wait_until(lambda: load.mark() >= target, 60, "requests after nginx returned")
        tail = load.since(after)
    # While nginx is down a client can only be refused or cut off: nothing hangs (every client
    # thread finished its loop), nothing else fails, and all requests after recovery succeed.
    assert set(counts) <= {"200"} | {k for k in counts if k.startswith("conn:")}, counts
    assert set(tail) == {"200"}, tail


FRONTENDS = ("frontends:frontend-0", "frontends:frontend-1")


def served_after(stack: Stack, load: Load, what: str) -> Counter:
    """Every worker ready, then 20 requests more of `load`: what they were answered."""
    stack.wait_until(stack.all_ready, 90, f"every worker ready after {what}")
    after = load.mark()
    stack.wait_until(lambda: load.mark() >= after + 20, 60, f"requests after {what}")
    return load.since(after)


def test_arenas_deleted_under_load_are_made_again(stack):
    """/dev/shm emptied under a running stack (a cleaner, systemd-logind's RemoveIPC): the
    workers dropped the vanished mappings and every request was 503 for good (an outside
    check). Each frontend sees its arena's file gone, stops (it drains) and supervisord starts
    it again with a new arena: the service comes back by itself."""
    cfg = config.load_resolved(stack.run_dir / "config.json")
    arenas = list(SHM.glob(topology.shm_prefix(cfg) + "*"))
    assert len(arenas) == 2, arenas  # one per frontend
    pids = {program: stack.pid(program) for program in FRONTENDS}
    with Load(stack) as load:
        for path in arenas:
            path.unlink()
        lost = stack.logged(("frontend-0", "frontend-1"), "frontend.file_lost", 2, timeout=30)

        def new_arenas() -> set[Path]:
            return set(SHM.glob(topology.shm_prefix(cfg) + "*")) - set(arenas)
        # (an arena is made as its frontend starts: after its new pid, before it serves)
        stack.wait_until(lambda: len(new_arenas()) == 2, 60, "both frontends' new arenas")
        assert all(stack.pid(p) not in (0, old) for p, old in pids.items())
        tail = served_after(stack, load, "the arenas' deletion")
    assert {line["lost"].split(" /")[0] for line in lost} == {"its shared-memory arena"}, lost
    assert set(tail) == {"200"}, tail


def test_socket_files_deleted_under_load_are_made_again(stack):
    """The run directory's sockets deleted under a running stack (by hand, a cleaner): nginx
    no longer reached the frontends, and a frontend started after found no worker, 503 for
    good (an outside check). The workers bind their files again; each frontend stops (it
    drains) and starts again on a new socket; a frontend killed after serves."""
    sockets = stack.run_dir / "sockets"
    files = sorted(p.name for p in sockets.iterdir())
    assert {"frontend-0.sock", "frontend-1.sock"} <= set(files), files
    def lost() -> list[dict]:
        return [line for program in ("frontend-0", "frontend-1")
                for line in stack.log_lines(program) if line.get("message") ==
                "frontend.file_lost" and line["lost"].startswith("its socket")]

    with Load(stack) as load:
        for name in files:
            (sockets / name).unlink()
        stack.wait_until(lambda: len(lost()) >= 2, 30, "both frontends' file_lost lines")
        stack.logged(("worker-0", "worker-1"), "worker.socket_lost", 2, timeout=30)
        stack.wait_until(lambda: sorted(p.name for p in sockets.iterdir()) == files, 60,
                         f"{files} made again")
        served_after(stack, load, "the sockets' deletion")
        counts = kill_and_wait(stack, "frontends:frontend-1", load)  # connects to the workers
    assert sorted(line["frontend"] for line in lost()) == [0, 1], lost()
    assert set(counts) == {"200"}, counts


def test_one_frontends_arena_deleted_under_load_fails_no_request(stack):
    """One frontend's arena file deleted: it drains what it holds through the workers'
    mappings, kept while it runs (they were dropped, and each of its requests answered 503:
    a soak check), and nginx sends the rest to the other frontend."""
    cfg = config.load_resolved(stack.run_dir / "config.json")
    arenas = list(SHM.glob(topology.shm_prefix(cfg) + "fe0-*"))
    assert len(arenas) == 1, arenas
    with Load(stack) as load:
        start = load.mark()
        arenas[0].unlink()
        stack.wait_until(lambda: set(SHM.glob(topology.shm_prefix(cfg) + "fe0-*")) - set(arenas),
                         60, "frontend-0's new arena")
        served_after(stack, load, "the arena's deletion")
        counts = load.since(start)
    assert set(counts) == {"200"}, counts
