"""GET /ready's status from what the heartbeats said (frontend.routes.readiness)."""

from types import SimpleNamespace

import pytest

from frontend.links import Pending, did_not_load
from frontend.pool import WorkerPool
from frontend.routes import readiness
from shmserve import state
from shmserve.protocol import PROTOCOL_VERSION, Heartbeat, ModelInfo, Unloaded


def models(*names: str):
    return SimpleNamespace(by_name={n: SimpleNamespace(variants=[SimpleNamespace(unit=n)])
                                    for n in names})


def beat(pool: WorkerPool, index: int, ready: bool, *served: str, pid: int = 0,
         failure: str = "", unloaded: tuple[Unloaded, ...] = ()) -> None:
    infos = tuple(ModelInfo(m, "embedding", 4, 8, "fp32", "r", "ready", "") for m in served)
    pool._on_heartbeat(pool.links[index], Heartbeat(
        PROTOCOL_VERSION, index, pid or 1_000_000 + index, ready, "cpu", infos, 0, 10, 0.0, 0.0,
        failure=failure, unloaded=unloaded))


@pytest.fixture
def restarted(pool):
    """A frontend started after every worker of the deployment had been ready once (a
    restarted one): the run directory says so (state.mark_started)."""
    pool.cfg.run_dir.mkdir(parents=True, exist_ok=True)
    state.mark_started(pool.cfg)
    again = WorkerPool(pool.cfg)
    yield again
    for link in again.links:
        link.socket.close(linger=0)
    again._ctx.term()


def test_loading_until_every_worker_was_ready_once(pool):
    assert readiness(pool, models("a")) == "loading"
    # At a deployment's start a worker answers pings while it loads (its socket thread binds
    # first), so the frontends hear it not ready before they hear it ready.
    beat(pool, 0, False, "a")
    beat(pool, 1, False, "a")
    assert readiness(pool, models("a")) == "loading"
    beat(pool, 0, True, "a")
    assert readiness(pool, models("a")) == "loading"  # serves, but not every worker is up yet
    beat(pool, 1, True, "a")
    assert readiness(pool, models("a")) == "ready"


def test_a_worker_ready_when_first_heard_does_not_end_the_start(pool):
    """At a fresh `up` a small model may be loaded before the frontends listen, so a worker's
    first heartbeat says ready while another worker still loads (or never started): loading
    (503) until every worker has been ready once. A ready first heartbeat counted as a running
    deployment, and /ready said degraded (200), `up --wait` "ready" (an outside check). Then
    the run directory records the start, for frontends restarted later."""
    pool.cfg.run_dir.mkdir(parents=True, exist_ok=True)
    beat(pool, 0, True, "a")
    assert readiness(pool, models("a")) == "loading"
    assert not state.has_started(pool.cfg)
    beat(pool, 1, True, "a")
    assert readiness(pool, models("a")) == "ready" and state.has_started(pool.cfg)
    pool._declare_dead(pool.links[1], "test")
    assert readiness(pool, models("a")) == "degraded"


def test_a_frontend_restarted_while_a_worker_is_down_degrades_instead_of_loading(restarted):
    """A frontend restarted into a running deployment is past the start: with another worker
    down for good it says degraded, as the frontends that saw the start do; it said loading
    (503) until that worker came back (an outside check)."""
    pool = restarted
    beat(pool, 0, True, "a")
    assert readiness(pool, models("a")) == "degraded"
    assert readiness(pool, models("a", "b")) == "unavailable"  # b has no ready worker
    beat(pool, 1, False, "a")  # the other one loads (restarted): still degraded
    assert readiness(pool, models("a")) == "degraded"
    beat(pool, 1, True, "a")
    assert readiness(pool, models("a")) == "ready"


def test_a_lost_worker_degrades_while_another_serves_every_model(pool):
    beat(pool, 0, True, "a")
    beat(pool, 1, True, "a")
    pool._declare_dead(pool.links[1], "test")
    assert readiness(pool, models("a")) == "degraded"
    beat(pool, 1, False, "a", pid=2_000_001)  # restarted: loading under a new pid
    assert readiness(pool, models("a")) == "degraded"
    pool._declare_dead(pool.links[0], "test")
    assert readiness(pool, models("a")) == "unavailable"
    beat(pool, 1, True, "a", pid=2_000_001)
    assert readiness(pool, models("a")) == "degraded"
    beat(pool, 0, True, "a", pid=2_000_000)
    assert readiness(pool, models("a")) == "ready"


def test_unavailable_when_the_only_worker_of_one_model_is_lost(pool):
    beat(pool, 0, True, "a")
    beat(pool, 1, True, "b")
    pool._declare_dead(pool.links[1], "test")
    assert readiness(pool, models("a", "b")) == "unavailable"
    assert readiness(pool, models("a")) == "degraded"


def test_kserve_server_ready_follows_the_same_rule(pool):
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from frontend import kserve
    from frontend.app import MODELS, POOL

    app = web.Application()
    app[POOL], app[MODELS] = pool, models("a")

    def status() -> int:
        request = make_mocked_request("GET", "/v2/health/ready", app=app)
        return asyncio.run(kserve.ready(request)).status

    assert status() == 400  # loading: KServe's "false" is a 4xx
    beat(pool, 0, True, "a")
    beat(pool, 1, True, "a")
    assert status() == 200
    pool._declare_dead(pool.links[1], "test")
    assert status() == 200  # degraded: the model is still served
    pool._declare_dead(pool.links[0], "test")
    assert status() == 400


def test_a_frontend_paused_itself_does_not_take_the_workers_for_dead(pool):
    """Silence counts from the frontend's own resumption: paused past the heartbeat timeout
    (3 s), it heard nothing through no fault of the workers."""
    import asyncio
    import time

    async def scenario():
        start = time.monotonic()
        for index in (0, 1):
            beat(pool, index, True, "a")
            pool.links[index].last_beat = start
        pool.watchdog.hung.tick(start)
        pool._round(start + 0.5)
        pool._round(start + 4.5)  # its own round 4 s late: it was paused
        assert all(link.alive for link in pool.links)
        for k in range(1, 6):  # then no heartbeat for 2.5 s after it resumed: still alive
            pool._round(start + 4.5 + 0.5 * k)
        assert all(link.alive for link in pool.links)
        pool._round(start + 7.6)  # 3.1 s of silence while awake
        assert not any(link.alive for link in pool.links)
        for link in pool.links:
            link.outbox.clear()

    asyncio.run(scenario())


async def test_a_new_frontends_first_ready_waits_for_the_first_heartbeats(pool, monkeypatch):
    """A frontend restarted into a running deployment answered its first /ready, asked before
    any heartbeat, "loading" (503): one failed probe per restarted frontend in a rolling
    restart that kept every worker ready (an outside check)."""
    import asyncio

    from frontend import pool as pool_module

    waiting = asyncio.create_task(pool.first_heard())
    await asyncio.sleep(0.05)
    assert not waiting.done()  # nothing heard yet
    beat(pool, 0, True, "a")
    await asyncio.sleep(0.01)
    assert not waiting.done()  # one of two
    beat(pool, 1, True, "a")
    await asyncio.wait_for(waiting, 1)
    assert readiness(pool, models("a")) == "ready"
    # Past the first seconds (a deployment still loading, its workers silent) it answers at
    # once, as before.
    monkeypatch.setattr(pool_module, "FIRST_HEARD_WINDOW_S", 0.0)
    pool._heard_all.clear()
    await asyncio.wait_for(pool.first_heard(), 0.05)


async def test_a_dropped_workers_unread_replies_are_read_before_its_requests_fail_over(pool):
    """A worker's last replies (a device error's 500) were failed over as 'worker lost' when
    this frontend's receive task read them later than the drop's grace (a loaded machine: once
    in a fresh-clone CI run, answered 503 instead of 500)."""
    import asyncio

    import zmq

    from frontend import pool as pool_module

    link = pool.links[0]
    future = asyncio.get_running_loop().create_future()
    link.pending[7] = Pending(future, 10, lambda: None)
    link.outstanding = 10
    unread = [True]
    real_get = link.socket.get
    link.socket.get = lambda key: (zmq.POLLIN if unread[0] else 0) if key == zmq.EVENTS \
        else real_get(key)
    pool._declare_dead(link, "connection dropped", grace=0.02)
    await asyncio.sleep(0.15)
    assert not future.done()  # a reply waits on the socket: not failed over yet
    unread[0] = False  # read (here: gone); the next grace fails what is left
    await asyncio.sleep(0.1)
    assert isinstance(future.exception(), pool_module.WorkerGone)


def test_held_slots_are_judged_once_a_worker_process_each_round(pool, monkeypatch):
    """A stopped worker's requests, up to frontends.max_inflight, stay held for it: every
    heartbeat round looked its pid up once an entry (~46 ms on the event loop for 1,024, a
    review); now once a pid, and only the gone process's slots are released."""
    import os

    from frontend import pool as pool_module

    released: list[int] = []
    link = pool.links[0]
    dead, live = 999_999_999, os.getpid()
    for seq in range(1, 1025):
        link.held[seq] = (dead, Pending(None, 1, lambda seq=seq: released.append(seq)))
    link.held[2000] = (live, Pending(None, 1, lambda: released.append(2000)))
    asked = []
    alive = pool_module.processes.alive
    monkeypatch.setattr(pool_module.processes, "alive", lambda pid: asked.append(pid) or
                        alive(pid))
    link.release_held(only_gone=True)
    assert sorted(asked) == sorted([dead, live])
    assert len(released) == 1024 and 2000 not in released and list(link.held) == [2000]


async def test_a_closing_worker_is_answered_and_what_it_did_not_answer_goes_elsewhere(pool):
    """A worker's last message (protocol.Closing) comes after every answer it owed: what is
    still pending never ran, and is handed on at once (WorkerClosed), its slot free, and the
    worker is told it was read (it holds its connection open until then: a dropped connection
    lost the 500 of a device error, which came back as 503)."""
    import asyncio

    from frontend.links import WorkerClosed
    from shmserve import wire
    from shmserve.protocol import Closing, ClosingSeen

    beat(pool, 0, True, "a")
    beat(pool, 1, True, "a")
    link = pool.links[0]
    pid = link.beat.pid
    future = asyncio.get_running_loop().create_future()
    settled: list[int] = []
    link.pending[7] = Pending(future, 10, lambda: settled.append(7))
    link.outstanding = 10
    # failed over while it was silent: its slot held until it answers or is gone
    link.held[5] = (pid, Pending(None, 1, lambda: settled.append(5)))
    link.held[6] = (pid - 1, Pending(None, 1, lambda: settled.append(6)))  # another process
    said: list[list[bytes]] = []

    def send(frames, flags=0):
        said.append(frames)
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    link.socket.send_multipart = send
    pool._on_closing(link, Closing(0, pid))
    assert isinstance(future.exception(), WorkerClosed) and sorted(settled) == [5, 7]
    assert list(link.held) == [6]
    assert link.pending == {} and link.outstanding == 0
    assert [wire.decode(frames) for frames in said] == [ClosingSeen(pool.frontend)]
    assert readiness(pool, models("a")) == "degraded"
    beat(pool, 0, True, "a", pid=pid)  # a heartbeat of its read late: not back
    assert not link.ready
    beat(pool, 0, True, "a", pid=pid + 1)  # its successor
    assert link.ready and readiness(pool, models("a")) == "ready"


async def test_a_worker_that_failed_unforeseen_has_its_requests_retried_as_a_lost_workers(pool):
    """Closing(answered=False): the worker failed mid-pass on something it did not foresee,
    and what it held may have run: those requests count against retry_on_worker_loss (a
    request that crashes every worker is not tried on each of them for nothing)."""
    import asyncio

    from frontend.links import WorkerClosed, WorkerGone
    from shmserve.protocol import Closing

    beat(pool, 0, True, "a")
    link = pool.links[0]
    future = asyncio.get_running_loop().create_future()
    link.pending[7] = Pending(future, 10, lambda: None)
    pool._on_closing(link, Closing(0, link.beat.pid, answered=False))
    error = future.exception()
    assert isinstance(error, WorkerGone) and not isinstance(error, WorkerClosed)
    assert not link.ready


def test_a_worker_of_another_protocol_is_ignored_and_named(restarted, caplog):
    """After an upgrade half taken, a worker restarted on the new code beside frontends of the
    old is not used: /ready names the protocol each worker's heartbeats speak, and the error is
    logged once (it was logged at every heartbeat: 713 lines in 30 s, an outside check)."""
    pool = restarted
    beat(pool, 0, True, "a")
    link = pool.links[1]
    for _ in range(3):
        pool._on_heartbeat(link, Heartbeat(PROTOCOL_VERSION + 1, 1, 1_000_001, True, "cpu", (),
                                           0, 10, 0.0, 0.0))
    assert len([r for r in caplog.records if "speaks protocol" in r.getMessage()]) == 1
    assert not link.ready and link.protocol == PROTOCOL_VERSION + 1
    assert pool.links[0].protocol == PROTOCOL_VERSION
    assert readiness(pool, models("a")) == "degraded"


def test_a_worker_whose_load_fails_is_named_and_the_state_is_failing(pool):
    """A worker whose models fail to load says why in its heartbeats before it exits
    (Heartbeat.failure); /ready says failing, not loading for ever, and counts the failures
    in a row, once per process, until the worker is ready (an outside check)."""
    beat(pool, 0, True, "a")
    beat(pool, 1, False, "a", failure="ModelSourceError: model.safetensors lacks 16 weights")
    assert readiness(pool, models("a")) == "failing"
    link = pool.links[1]
    assert (link.failed_loads, link.load_error) == (
        1, "ModelSourceError: model.safetensors lacks 16 weights")
    beat(pool, 1, False, "a", failure="ModelSourceError: model.safetensors lacks 16 weights")
    assert link.failed_loads == 1  # the same process again: one failure
    beat(pool, 1, False, "a", pid=2_000_001)  # started again, loading: the error stays
    assert readiness(pool, models("a")) == "failing" and link.load_error
    beat(pool, 1, False, "a", pid=2_000_001, failure="OSError: disk")
    assert (link.failed_loads, link.load_error) == (2, "OSError: disk")
    beat(pool, 1, True, "a", pid=2_000_002)
    assert readiness(pool, models("a")) == "ready"
    assert (link.failed_loads, link.load_error) == (0, None)


def test_a_frontend_started_after_failed_loads_counts_them_all(restarted):
    """The failures in a row are the worker's count (its run directory's), not those this
    frontend heard: one started after two said 1 while the worker's log said 3 (recheck51)."""
    pool = restarted
    for _ in range(3):
        state.count_load_failure(pool.cfg, 1)  # as the worker counts them before it exits
    beat(pool, 1, False, "a", pid=2_000_001, failure="ModelSourceError: gone")
    assert pool.links[1].failed_loads == 3


def test_past_the_start_a_failing_worker_degrades_or_fails_by_what_it_served(restarted):
    pool = restarted
    beat(pool, 0, True, "a")
    beat(pool, 1, False, "b", failure="ModelSourceError: gone")
    assert readiness(pool, models("a")) == "degraded"  # every model still served
    assert readiness(pool, models("a", "b")) == "failing"  # b by no ready worker


def test_a_worker_serving_without_a_model_it_could_not_load(pool):
    """A worker whose one model failed to load while its others loaded serves those
    (Heartbeat.unloaded): /ready fails while no other worker serves that model, degrades
    while one does, and is ready once it loads; did_not_load says why, for the requests."""
    b = Unloaded("b", "ModelSourceError: lacks 16 weights", 2, 3.5)
    beat(pool, 0, True, "a", unloaded=(b,))
    beat(pool, 1, True, "a")
    assert readiness(pool, models("a", "b")) == "failing"
    assert pool.links[0].load_error is None  # it is ready: no failed start
    assert did_not_load(pool.links, "b") == (
        "worker 0: ModelSourceError: lacks 16 weights (2 failed load(s) in a row)", 3.5)
    assert did_not_load(pool.links, "a") == ("", 0.0)
    beat(pool, 1, True, "a", "b")
    assert readiness(pool, models("a", "b")) == "degraded"  # b served by worker 1
    beat(pool, 0, True, "a", "b")
    assert readiness(pool, models("a", "b")) == "ready"
    assert did_not_load(pool.links, "b") == ("", 0.0)


def test_a_split_is_served_while_one_of_its_arms_is(pool):
    """An arm without a ready worker gives its share to the others (frontend.variants), so
    the split's requests succeed: degraded (200), not a 503 that takes the pod out."""
    split = SimpleNamespace(by_name={"s": SimpleNamespace(variants=[
        SimpleNamespace(unit="s@a"), SimpleNamespace(unit="s@b")])})
    beat(pool, 0, True, "s@a", unloaded=(Unloaded("s@b", "OSError: gone", 1, 1.0),))
    beat(pool, 1, True, "s@a")
    assert readiness(pool, split) == "degraded"
    beat(pool, 0, True, unloaded=(Unloaded("s@a", "x", 1, 1.0), Unloaded("s@b", "x", 1, 1.0)))
    beat(pool, 1, True)
    assert readiness(pool, split) == "failing"  # neither arm
