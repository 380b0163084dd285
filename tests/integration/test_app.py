"""The frontend app's middleware against a real worker subprocess (no nginx, no supervisord):
what the access line carries with logging.log_inputs on (off: tests/e2e/test_observability.py)."""

from __future__ import annotations

import asyncio
import logging

from aiohttp.test_utils import TestClient, TestServer

from frontend.app import create_app
from tests.conftest import tiny_overrides
from tests.integration.conftest import run_config
from tests.integration.test_pool import start_worker


async def until_ready(client: TestClient) -> None:
    for _ in range(600):  # the worker loads the model: up to 60 s
        async with client.get("/ready") as resp:
            if resp.status == 200:
                return
        await asyncio.sleep(0.1)
    raise AssertionError("the worker was not ready within 60 s")


def test_access_line_has_every_stage_and_the_inputs_when_asked(tmp_path, tiny_model, caplog):
    cfg = run_config(tmp_path, tiny_overrides(tiny_model, frontends={"count": 1},
                                              logging={"log_inputs": True}))
    caplog.set_level(logging.INFO, logger="shmserve.access")
    worker = start_worker(cfg)

    async def scenario():
        async with TestClient(TestServer(create_app(cfg, 0))) as client:
            await until_ready(client)
            async with client.post("/predict", json={"texts": ["keep me", "and me"]},
                                   headers={"X-Request-ID": "inputs-1"}) as resp:
                assert resp.status == 200, await resp.text()
                headers = resp.headers
            async with client.get("/info") as resp:
                info = await resp.json()
            return headers, info

    try:
        headers, info = asyncio.run(scenario())
    finally:
        worker.kill()
        worker.wait()
    for name in ("X-Tokenization-Time", "X-Queue-Time", "X-Inference-Time", "X-Total-Time",
                 "X-Batch-Size", "X-Model-Revision"):
        assert name in headers, name
    (line,) = [r.fields for r in caplog.records
               if r.name == "shmserve.access" and r.fields["request_id"] == "inputs-1"]
    assert line["inputs"] == ["keep me", "and me"]
    assert line["texts"] == 2 and line["status"] == 200 and line["route"] == "/predict"
    parts = ("tokenize_ms", "handoff_ms", "queue_ms", "inference_ms", "transfer_ms")
    for key in parts:
        assert 0 <= line[key] <= line["total_ms"], key
    assert sum(line[key] for key in parts) <= line["total_ms"] + 0.005  # disjoint (rounding)
    assert info["model_id"] == "tiny" and info["frontends"] == 1
    assert info["devices"][0]["ready"] is True


def test_large_answers_go_unbuffered_within_the_frontends_budget(tmp_path, tiny_model,
                                                                 monkeypatch):
    """An unbuffered answer stays in the frontend until a slow client has read it; past
    UNBUFFERED_BUDGET of them, answers go buffered (nginx takes them at once), and what was held
    is let go when its response is freed."""
    import gc

    from aiohttp import web

    from frontend import app as frontend_app

    cfg = run_config(tmp_path, tiny_overrides(tiny_model, frontends={"count": 1}))
    monkeypatch.setattr(frontend_app, "UNBUFFERED_BYTES", 1024)

    async def unbuffered(budget: int) -> tuple[bool, int]:
        monkeypatch.setattr(frontend_app, "UNBUFFERED_BUDGET", budget)
        async with TestClient(TestServer(create_app(cfg, 0))) as client:
            async with client.get("/openapi.json") as resp:
                size = len(await resp.read())
                return resp.headers.get("X-Accel-Buffering") == "no", size

    sent, size = asyncio.run(unbuffered(1 << 30))
    assert sent and size > 1024
    assert asyncio.run(unbuffered(size - 1)) == (False, size)

    held = frontend_app.Unbuffered(2 * size)
    first, second = web.Response(body=b"x"), web.Response(body=b"x")
    assert held.take(first, size) and held.take(second, size)
    assert not held.take(web.Response(body=b"x"), size) and held.held == 2 * size
    del first
    gc.collect()
    assert held.held == size and held.take(web.Response(body=b"x"), size)


def test_a_scrape_is_answered_while_every_tokenizing_thread_is_busy(tmp_path, tiny_model):
    """A scrape's exposition has a thread of its own: in the default executor (the one
    tokenization runs in) it waited behind a flood's tokenizing, past nginx's timeout (504;
    an outside check)."""
    import threading

    cfg = run_config(tmp_path, tiny_overrides(tiny_model, frontends={"count": 1}))
    release = threading.Event()

    async def scenario() -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        async with TestClient(TestServer(create_app(cfg, 0))) as client:
            # every thread of the default executor taken, and work queued behind them
            busy = [loop.run_in_executor(None, release.wait) for _ in range(64)]
            try:
                async with asyncio.timeout(10):
                    async with client.get("/metrics") as resp:
                        return resp.status, await resp.read()
            finally:
                release.set()
                await asyncio.gather(*busy)

    status, body = asyncio.run(scenario())
    assert status == 200 and b"shmserve_requests_total" in body


def test_an_unexpected_error_in_a_frontend_is_a_500_naming_the_request_not_a_traceback(
        tmp_path, tiny_model, caplog):
    """The global handler: whatever a route raises is a 500 internal_error, in the API's
    shape, quoting the request id and none of the exception, with the traceback in the log
    line, and an access line at level error (no input from outside reached it in an outside
    check; here a route that fails)."""
    cfg = run_config(tmp_path, tiny_overrides(tiny_model, frontends={"count": 1}))
    caplog.set_level(logging.INFO)
    app = create_app(cfg, 0)

    async def boom(request):
        raise RuntimeError("a secret detail")

    app.router.add_post("/boom", boom)

    async def scenario():
        async with TestClient(TestServer(app)) as client:
            async with client.post("/boom", headers={"X-Request-ID": "boom-fe"}) as resp:
                return resp.status, await resp.json()

    status, body = asyncio.run(scenario())
    assert status == 500 and body["error"]["type"] == "internal_error", body
    assert "boom-fe" in body["error"]["message"] and "secret" not in str(body), body
    (logged,) = [r for r in caplog.records if r.getMessage() == "unhandled error"]
    assert logged.fields["request_id"] == "boom-fe" and "a secret detail" in logged.exc_text
    (access,) = [r for r in caplog.records if r.name == "shmserve.access"
                 and r.fields["request_id"] == "boom-fe"]
    assert access.levelname == "ERROR" and access.fields["status"] == 500


def test_a_kserve_request_pinned_to_a_version_a_reload_replaced_meanwhile_is_refused(
        tmp_path, tiny_model, monkeypatch):
    """A version in the path pins the request (docs/protocols.md): checked against what the
    frontend last heard, then run; a reload between the two answered the new version's rows
    (2 of ~380 pinned requests across a reload, an outside check). Here the frontend's view is
    made stale (it believes the worker serves tiny-r0; the worker serves tiny-r1): 404 naming
    both, not another version's rows."""
    from frontend import kserve

    cfg = run_config(tmp_path, tiny_overrides(tiny_model, frontends={"count": 1}))
    worker = start_worker(cfg)
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}

    async def scenario():
        async with TestClient(TestServer(create_app(cfg, 0))) as client:
            await until_ready(client)
            answers = []
            for version in ("tiny-r1", "tiny-r0"):
                monkeypatch.setattr(kserve, "revision", lambda variant, pool: version)
                async with client.post(f"/v2/models/tiny/versions/{version}/infer",
                                       json=body) as resp:
                    answers.append((resp.status, await resp.json()))
            return answers

    try:
        (ok, ok_body), (stale, stale_body) = asyncio.run(scenario())
    finally:
        worker.kill()
        worker.wait()
    assert ok == 200 and ok_body["model_version"] == "tiny-r1", ok_body
    assert stale == 404, stale_body
    assert stale_body["error"] == ("model 'tiny' has no version 'tiny-r0' any more: a reload "
                                   "replaced it with 'tiny-r1' while this request ran")


def test_a_request_whose_arm_lost_its_last_worker_after_the_choice_goes_to_a_served_arm(
        tmp_path, tiny_model, caplog):
    """A split's arm is chosen among those served; its last worker may stop between the choice
    and the request's dispatch, the others not having loaded it (model_not_loaded): an arm
    still served answers it, as the choice would have given it (an outside check saw a 503 at
    a worker's drain). Here the dispatcher's answer for arm b is that one. Its rows are not
    kept in the response cache as arm b's. And weights that give every share to an arm not
    served are taken with a warning."""
    from frontend.app import DISPATCHER, POOL
    from frontend.errors import ApiError

    overrides = tiny_overrides(tiny_model, frontends={"count": 1, "response_cache_mb": 8},
                               admin={"token": "arm-test-token"})
    caplog.set_level(logging.INFO, logger="shmserve.access")
    overrides["models"] = [{"name": "ab", "variants": [
        {"name": "a", "source": str(tiny_model), "revision": "a1"},
        {"name": "b", "source": str(tiny_model), "revision": "b1"}]}]
    cfg = run_config(tmp_path, overrides)
    worker = start_worker(cfg)
    app = create_app(cfg, 0)

    async def scenario() -> tuple[list[tuple[int, str]], list[str]]:
        async with TestClient(TestServer(app)) as client:
            await until_ready(client)
            dispatcher, pool = app[DISPATCHER], app[POOL]
            real_run, real_ready = dispatcher.run, pool.ready_links
            lost: list[str] = []
            back: list[bool] = []

            async def run(unit, *args):
                if unit == "ab@b" and not back:  # its worker stopping, the other never loaded it
                    lost.append(unit)
                    raise ApiError("unavailable", "model 'ab@b' did not load (worker 1: ...)",
                                   code="model_not_loaded")
                return await real_run(unit, *args)
            dispatcher.run = run
            pool.ready_links = lambda unit: [] if unit in lost else real_ready(unit)
            answers = []
            for i in range(6):  # arm b has half the share: one of the first three takes it
                async with client.post("/v1/embeddings", json={"model": "ab", "input": ["x"]},
                                       headers={"X-Request-ID": f"arm-{i}"}) as resp:
                    answers.append((resp.status, resp.headers.get("X-Model-Variant", "")))
            # Weights that leave the served arm no share: said in the answer (an outside
            # check set them so, b not loaded, and got 503s for every request unwarned)
            said = []
            for weights in ({"a": 0, "b": 1}, {"a": 1, "b": 1}):
                async with client.put("/admin/models/ab/split", json={"weights": weights},
                                      headers={"Authorization": "Bearer arm-test-token"}) as resp:
                    said.append((resp.status, (await resp.json()).get("warning", "")))
            back.append(True)  # arm b served again: its first answer of "x" is computed
            pool.ready_links = real_ready
            for i in range(4):
                async with client.post("/v1/embeddings", json={"model": "ab", "input": ["x"]},
                                       headers={"X-Request-ID": f"back-{i}"}) as resp:
                    assert resp.status == 200
            return answers, lost, said

    try:
        answers, lost, said = asyncio.run(scenario())
    finally:
        worker.kill()
        worker.wait()
    assert lost == ["ab@b"]  # sent there once, then served by arm a
    assert answers == [(200, "a")] * 6, answers
    lines = [r.fields for r in caplog.records if r.name == "shmserve.access"
             and r.fields["request_id"].startswith("back-") and r.fields.get("variant") == "b"]
    assert lines and lines[0].get("cache") != "hit", lines
    assert said[0][0] == 200 and said[0][1].startswith("no worker serves b now"), said
    assert said[1] == (200, ""), said
