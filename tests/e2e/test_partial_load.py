"""A worker one of whose models fails to load serves its others, and loads that one once it
can (README: Reliability, "A model that fails to load"). Before, it exited, and every model it
hosted went unserved while supervisord restarted it."""

import json
import shutil
import time

import numpy as np

from tests.conftest import tiny_overrides
from tests.stack import Stack
from tests.tinymodel import widen

TOKEN = "partial-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def test_a_model_that_does_not_load_leaves_the_others_served(tmp_path, tiny_model):
    roots = tmp_path / "models"
    good, bad, mended, arm = (roots / "tiny", roots / "second", roots / "second-v2",
                              roots / "split-b")
    for each in (good, bad, mended, arm):
        shutil.copytree(tiny_model, each)
    overrides = tiny_overrides(tiny_model, frontends={"count": 1}, workers={"cpu_workers": 1},
                               admin={"token": TOKEN})
    overrides["model_roots"] = [str(roots)]
    first = {**overrides["models"][0], "source": str(good)}
    overrides["models"] = [first, {**first, "name": "second", "aliases": [], "source": str(bad),
                                   "revision": "second-r1"},
                           {"name": "split", "variants": [
                               {"name": "a", "source": str(good), "revision": "a1"},
                               {"name": "b", "source": str(arm), "revision": "b1"}]}]
    stack = Stack(tmp_path / "s", overrides)
    stack.up()
    try:
        def embed(model: str):
            return stack.post_json("/v1/embeddings", {"model": model, "input": ["a b c"]})

        def reload(**body):
            return stack.post_json("/admin/models/second/reload", body, ADMIN)

        status, _, body = embed("second")
        assert status == 200, body
        vector = body["data"][0]["embedding"]

        saved = widen(bad / "model.safetensors")
        # (an arm whose weights are gone: its files do not read, which stopped the worker at
        # once, before any heartbeat, an outside check)
        arm_saved = (arm / "model.safetensors").read_bytes()
        (arm / "model.safetensors").unlink()
        pid = stack.pid("workers:worker-0")
        done = stack.cli("restart", "worker-0", check=False, timeout=200)
        # The restart says so and stops there (a rolling restart would have taken the model
        # from the next worker too, its files being the same).
        assert done.returncode == 2, done.stdout + done.stderr
        assert "worker-0 is ready without second" in done.stderr, done.stderr
        assert "[30522, 33]" in done.stderr, done.stderr
        assert stack.pid("workers:worker-0") != pid
        pid = stack.pid("workers:worker-0")

        # The other model is served; this one is answered 503 at once (not after
        # frontends.no_worker_wait_s), saying why.
        status, _, body = embed("tiny")
        assert status == 200, body
        started = time.monotonic()
        status, headers, body = embed("second")
        took = time.monotonic() - started
        error = body["error"]
        assert status == 503 and error["code"] == "model_not_loaded", (status, body)
        assert "did not load" in error["message"] and "[30522, 33]" in error["message"], error
        assert int(headers["Retry-After"]) >= 1
        assert took < 2.0, took
        # A split whose arm did not load: the other arm answers its share meanwhile.
        variants = {embed("split")[1]["X-Model-Variant"] for _ in range(10)}
        assert variants == {"a"}, variants
        (arm / "model.safetensors").write_bytes(arm_saved)  # mended: loaded at its next try

        status, _, body = stack.get("/ready")
        ready = json.loads(body)
        assert (status, ready["status"]) == (503, "failing"), ready
        worker = ready["workers"][0]
        assert worker["ready"] and worker["load_error"] is None, worker
        [unloaded] = [u for u in worker["unloaded"] if u["model"] == "second"]
        assert unloaded["failures"] >= 1, unloaded
        [gone] = [u for u in worker["unloaded"] if u["model"] == "split@b"]
        assert "model.safetensors" in gone["error"], gone
        assert "[30522, 33]" in unloaded["error"]

        status, _, body = stack.get("/admin/models", ADMIN)
        models = {m["name"]: m for m in json.loads(body)["models"]}
        assert models["tiny"]["workers"][0]["state"] == "ready", models
        assert models["second"]["workers"][0]["state"] == "failed", models
        assert "[30522, 33]" in models["second"]["workers"][0]["load_error"]
        # Triton's repository index says the same: UNAVAILABLE with why, the others READY
        # (a split: a version per arm; b's weights are back, so it may be loading again)
        status, _, raw = stack.request("POST", "/v2/repository/index", b"", {})
        index = {(m["name"], m["version"]): m for m in json.loads(raw)}
        assert status == 200 and index[("second", "second-r1")]["state"] == "UNAVAILABLE"
        assert "[30522, 33]" in index[("second", "second-r1")]["reason"], index
        assert index[("split", "a1")]["state"] == "READY" and ("split", "b1") in index
        assert [m["state"] for m in index.values() if m["name"] == "tiny"] == ["READY"]
        status, _, raw = stack.request("POST", "/v2/repository/index", b'{"ready": true}',
                                       {"Content-Type": "application/json"})
        assert ("second", "second-r1") not in {(m["name"], m["version"])
                                               for m in json.loads(raw)}

        _, _, raw = stack.get("/metrics")
        counted = [line for line in raw.decode().splitlines()
                   if line.startswith("shmserve_worker_model_load_failures_total{")
                   and 'model="second"' in line]
        assert counted and float(counted[0].rsplit(" ", 1)[1]) >= 1, counted

        shown = stack.cli("status", check=False).stdout
        assert "worker 0: serves without second, whose load failed" in shown, shown

        # A reload gives it a source to load at once, the call waiting until its worker has;
        # one it could not serve is refused, from the frontend's check of its files or from
        # the worker's load, and leaves the run state as it was.
        status, _, body = reload(source=str(tmp_path))
        assert status == 422 and body["error"]["param"] == "source", body
        broken = roots / "second-broken"
        shutil.copytree(tiny_model, broken)
        widen(broken / "model.safetensors")
        status, _, body = reload(source=str(broken))
        assert status == 422 and body["error"]["param"] == "source", body
        assert "nothing changed" in body["error"]["message"], body
        assert "second-broken" in body["error"]["message"] and "[30522, 33]" in \
            body["error"]["message"], body
        assert "second" not in json.loads((stack.run_dir / "state.json").read_text()).get(
            "sources", {}), "the refused source stays out of the run state"
        status, _, body = reload(source=str(mended))
        assert status == 200, body
        [entry] = body["workers"]
        assert entry["ok"] and entry["message"] == "loaded", entry
        assert embed("second")[0] == 200  # served when the call returns
        assert np.allclose(embed("second")[2]["data"][0]["embedding"], vector, atol=1e-6)
        # ("ready", not the 200 of "degraded": split's arm b loads at its next try, and
        # until then arm a took its share: a CI run saw {"a"})
        stack.wait_until(lambda: json.loads(stack.get("/ready")[2])["status"] == "ready", 40,
                         "every model loaded")
        assert stack.pid("workers:worker-0") == pid
        assert {embed("split")[1]["X-Model-Variant"] for _ in range(10)} == {"a", "b"}

        # `up --wait` stops at its third failed load, saying so; what loaded is served.
        stack.down()
        started = time.monotonic()
        done = stack.cli("up", "--wait", "--timeout", "200", check=False, timeout=250)
        assert done.returncode == 1, done.stdout + done.stderr
        last = done.stderr.splitlines()[-1]
        assert "worker 0 serves without second, whose load failed 3 times in a row" in last
        assert "[30522, 33]" in last and "the rest is served" in last, last
        assert time.monotonic() - started < 60
        assert embed("tiny")[0] == 200

        # Mended in place: loaded by the same process at its next try (1, 2, 4 ... s apart).
        pid = stack.pid("workers:worker-0")
        (bad / "model.safetensors").write_bytes(saved)
        stack.wait_until(lambda: embed("second")[0] == 200, 60, "second served again")
        assert np.allclose(embed("second")[2]["data"][0]["embedding"], vector, atol=1e-6)
        stack.wait_until(lambda: stack.get("/ready")[0] == 200, 10, "ready")
        assert stack.pid("workers:worker-0") == pid
        failed = [line for line in stack.log_lines("worker-0")
                  if line.get("message") == "worker.load_failed" and line["pid"] == pid]
        assert failed and all(line["model"] == "second" for line in failed), failed
        assert [line["retry_in_s"] for line in failed[-3:]] == [1.0, 2.0, 4.0], failed
    finally:
        stack.down()


def with_broken(tmp_path, tiny_model, second) -> Stack:
    """A stack of two workers serving the tiny model and `second(good, broken)`, a model entry
    given the tiny model's folder and a copy of it whose weights do not fit its config."""
    roots = tmp_path / "models"
    good, broken = roots / "tiny", roots / "broken"
    for each in (good, broken):
        shutil.copytree(tiny_model, each)
    widen(broken / "model.safetensors")
    overrides = tiny_overrides(tiny_model, workers={"cpu_workers": 2})
    overrides["model_roots"] = [str(roots)]
    overrides["models"] = [{**overrides["models"][0], "source": str(good)},
                           second(str(good), str(broken))]
    return Stack(tmp_path / "s", overrides)


def test_frontends_restart_past_a_workers_unloaded_arm(tmp_path, tiny_model):
    """A frontend's restart (restart frontends, and apply's) waits for that frontend alone: a
    worker's unloaded model (a split's arm, the other arm serving) is not the frontend's. It
    read the unloaded models of the worker of the frontend's index, so `restart frontends`
    stopped at frontend-0, and an apply removing the broken arm stopped at every rerun (an
    outside check)."""
    stack = with_broken(tmp_path, tiny_model, lambda good, broken: {"name": "split", "variants": [
        {"name": "a", "source": good, "revision": "a1"},
        {"name": "b", "source": broken, "revision": "b1"}]})
    stack.up()
    try:
        status, _, body = stack.get("/ready")
        assert status == 200 and json.loads(body)["status"] == "degraded", body
        # /info gives each arm's workers and their state of it
        split = next(m for m in json.loads(stack.get("/info")[2])["models"]
                     if m["name"] == "split")
        assert [v["workers"] for v in split["variants"]] == [
            [{"worker": 0, "state": "ready"}, {"worker": 1, "state": "ready"}],
            [{"worker": 0, "state": "failed"}, {"worker": 1, "state": "failed"}]], split
        done = stack.cli("restart", "frontends", check=False, timeout=200)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "frontend-1 ready" in done.stdout, done.stdout + done.stderr
    finally:
        stack.down()


def test_frontends_restart_where_a_model_loads_on_no_worker(tmp_path, tiny_model):
    """GET /ready is 503 "failing" while a model loads nowhere (pinned to a worker that cannot
    load it): a frontend's restart has nothing to wait for once it sees every worker ready or
    failed, and says so, where it waited out its whole timeout (an outside check: ~300 s, then
    "frontend-0 not ready")."""
    stack = with_broken(tmp_path, tiny_model, lambda good, broken: {
        "name": "broken", "source": broken, "devices": [1]})
    stack.cli("up", "--wait", "--timeout", "120", check=False, timeout=180)
    try:
        stack.wait_until(lambda: stack.get("/ready")[0] == 503 and json.loads(
            stack.get("/ready")[2])["status"] == "failing", 60, "/ready failing")
        # /info says where: the worker it is pinned to failed it
        described = {m["name"]: m for m in json.loads(stack.get("/info")[2])["models"]}
        assert described["broken"]["workers"] == [{"worker": 1, "state": "failed"}], described
        started = time.monotonic()
        done = stack.cli("restart", "frontends", "--timeout", "40", check=False, timeout=200)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "frontend-1 ready" in done.stdout, done.stdout + done.stderr
        assert "frontend-0 serves, and its GET /ready says failing" in done.stderr, done.stderr
        assert "loads on no worker (not loaded: broken (worker 1);" in done.stderr, done.stderr
        assert time.monotonic() - started < 35
        status, _, body = stack.post_json("/v1/embeddings", {"model": "tiny", "input": "x"})
        assert status == 200, body
    finally:
        stack.down()
