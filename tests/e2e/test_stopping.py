"""Stopping under load: a frontend's drain, `shmserve down` with a backlog, and in-flight work
finished at a graceful stop (overload and admission: test_reliability)."""

import concurrent.futures
import contextlib
import json
import os
import signal
import threading

from tests.conftest import tiny_overrides
from tests.e2e.test_reliability import LONG, inflight, queued_texts, slow_stack
from tests.stack import Stack


def test_a_stopping_frontend_answers_503_when_its_drain_ends_before_the_worker(tmp_path,
                                                                            tiny_model):
    """A frontend stopped (a restart) while its requests wait on a worker that has not answered
    when server.drain_timeout_s ends: each gets a 503 with Retry-After, and the frontend exits
    cleanly. aiohttp cancelled them at the drain's end and cut their connections, which nginx
    answered 502 (an outside check: 140 requests in a rolling restart behind a backlog)."""
    stack = Stack(tmp_path / "s", tiny_overrides(
        tiny_model, frontends={"count": 1}, server={"drain_timeout_s": 3},
        workers={"heartbeat_timeout_s": 60, "hung_kill_s": 120}))
    stack.up()
    try:
        worker = stack.pid("workers:worker-0")
        frontend = stack.pid("frontends:frontend-0")
        os.kill(worker, signal.SIGSTOP)  # it will not answer within the drain
        try:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                waiting = [pool.submit(stack.post_json, "/v1/embeddings", {"input": [f"w {i}"]})
                           for i in range(4)]
                stack.wait_until(lambda: inflight(stack) == 4, 30, "the requests to wait")
                os.kill(frontend, signal.SIGTERM)  # as supervisord stops it in a restart
                answers = [future.result(timeout=30) for future in waiting]
        finally:
            os.kill(worker, signal.SIGCONT)
        for status, headers, body in answers:
            assert status == 503, (status, body)
            assert headers["Retry-After"] == "1" and body["error"]["type"] == "unavailable"
            assert "server.drain_timeout_s" in body["error"]["message"]
        # it exited on its own, 0, before supervisord's SIGKILL (stopwaitsecs) was due
        stack.wait_until(lambda: "exited: frontend-0 (exit status 0;" in stack.log("supervisord"),
                         30, "the frontend's exit")
        ended = [json.loads(line) for line in stack.log("frontend-0").splitlines()
                 if "frontend.drain_ended" in line]
        assert [line["answered_503"] for line in ended] == [4]
        stack.wait_until(lambda: stack.get("/ready")[0] == 200, 60, "the restarted frontend")
        assert stack.post_json("/v1/embeddings", {"input": ["after"]})[0] == 200
    finally:
        stack.down()


def test_down_answers_every_request_a_backlog_holds_past_the_drain(tmp_path, tiny_model):
    """`shmserve down` while requests wait on a worker that will not answer in time: each gets
    a 503 and nginx exits by itself. supervisord stops nginx first, which waited for those
    requests while the frontends, not yet told to stop, waited on the worker, until
    supervisord SIGKILLed nginx and cut them (an outside check: 28 and 55 requests). The
    reaper now sets the frontends draining as supervisord begins to stop."""
    stack = Stack(tmp_path / "s", tiny_overrides(
        tiny_model, frontends={"count": 2}, server={"drain_timeout_s": 3},
        workers={"heartbeat_timeout_s": 60, "hung_kill_s": 120}))
    stack.up()
    worker = stack.pid("workers:worker-0")
    os.kill(worker, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            waiting = [pool.submit(stack.post_json, "/v1/embeddings", {"input": [f"w {i}"]})
                       for i in range(4)]
            stack.wait_until(lambda: inflight(stack) == 4, 30, "the requests to wait")
            # resumed once nginx was past its stopwaitsecs (8 s), for the workers' own stop
            threading.Timer(10, os.kill, (worker, signal.SIGCONT)).start()
            stack.down()
            answers = [future.result(timeout=60) for future in waiting]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)
    assert [status for status, _, _ in answers] == [503] * 4, answers
    log = stack.log("supervisord")
    assert "killing 'nginx' with SIGKILL" not in log and "stopped: nginx (exit status 0)" in log
    assert "reaper.frontends_draining" in stack.log("reaper")


def test_graceful_stop_finishes_in_flight_work(tmp_path, slow_model):
    stack = slow_stack(tmp_path / "s", slow_model, frontends={"count": 1},
                       batching={"max_batch_size": 1}, workers={"torch_threads": 1})
    stack.up()
    results = {}
    busy = threading.Thread(target=lambda: results.update(
        a=stack.post_json("/predict", {"texts": [LONG] * 20})))
    busy.start()
    stack.wait_until(lambda: queued_texts(stack) > 0, 30, "work in flight")
    stack.down()  # SIGQUIT to nginx, SIGTERM to the rest: drain, then exit
    busy.join(60)
    status, _, body = results["a"]
    assert status == 200 and len(body["results"]) == 20
    assert "exit status 0" in stack.log("supervisord") or "stopped: workers:worker-0 (exit " \
        "status 0)" in stack.log("supervisord")
    assert not list((stack.run_dir / "sockets").glob("*"))
