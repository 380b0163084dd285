"""Hot reload when processes die at bad moments or sources break: the workers converge on the
run state (state.json), a gone frontend's reload is dropped, a broken recorded source is
mended by a reload (docs/models.md, "Hot reload"). Through nginx under load, on two workers and
two frontends, with the stack and helpers of tests/e2e/test_reload.py (a stack of this file's
own); the tests run in file order, each from the revision the previous one left.
"""

import json
import os
import shutil
import signal
import time

import pytest

from shmserve.models import weights_digest
from tests.e2e import test_reload as base
from tests.e2e.test_reload import TOKEN, Load, reload, revisions, settles_on
from tests.stack import Stack
from tests.tinymodel import build_tiny_bert
from tests.conftest import TINY_MAX_TOKENS

# test_reload's fixtures: a stack (and its models) of this module's own
models = base.models
stack = base.stack


def test_a_reload_whose_frontend_is_killed_frees_its_standby_at_once(stack, models):
    """Served before: a (tiny-r1). After: deep (its digest). A reload's frontend SIGKILLed while
    the workers loaded: they loaded on, staged, and held the standby (and refused every other
    reload 409) for admin.reload_timeout_s, 100 s (an outside check). Now a worker drops a gone
    frontend's reloads when it sees the process gone, and a reload through nginx goes ahead."""
    import socket

    # Six layers with a wide feed-forward: its load and warm-up last about a second
    deep = build_tiny_bert(models["root"] / "deep", seed=11, layers=6, intermediate=4096,
                           max_positions=TINY_MAX_TOKENS)
    digest = weights_digest(deep / "model.safetensors")
    assert reload(stack, "tiny", source=str(deep))[0] == 200
    settles_on(stack, digest)
    stack.wait_until(stack.all_ready, 30, "both frontends ready")
    victim = stack.pid("frontends:frontend-0")
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(str(stack.run_dir / "sockets" / "frontend-0.sock"))
    body = json.dumps({"source": str(models["root"] / "deep")}).encode()
    sock.sendall(b"POST /admin/models/tiny/reload HTTP/1.1\r\nHost: x\r\n"
                 b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    stack.wait_until(lambda: any(state == "loading" for state, _, _ in revisions(stack)), 10,
                     "a worker loading the reload")
    os.kill(victim, signal.SIGKILL)
    sock.settimeout(5)
    try:
        assert sock.recv(1024) == b""  # killed before it answered: the case to check
    except ConnectionResetError:
        pass
    sock.close()
    # (well under admin.reload_timeout_s, 100 s)
    stack.wait_until(lambda: revisions(stack) == [("ready", digest, None)] * 2, 15,
                     "both workers ready, no standby held")
    stack.wait_until(lambda: [
        line for worker in ("worker-0", "worker-1") for line in stack.log_lines(worker)
        if line.get("message") in ("worker.reload_cancelled", "worker.reload_dropped")
        and line.get("reason") == "frontend_gone"], 5, "a worker's line (through supervisord) "
        "saying it dropped the gone frontend's reload")
    stack.wait_until(lambda: stack.pid("frontends:frontend-0") not in (0, victim)
                     and stack.all_ready(), 60, "frontend-0 back, workers ready")
    status, answer = reload(stack, "tiny")
    assert status == 200 and answer["revision"] == digest, answer


def test_workers_serve_what_the_run_state_records_even_without_a_commit(stack, models):
    """Served before: deep. After: b, as tiny-r4, under load without a failed request. The
    run state (state.json) records b as a reload's frontend does before it commits, and no
    commit comes: the frontend died in between, or a worker restarted during the reload and
    loaded what the state recorded before it. Either left a model answered from two revisions
    until a restart (an outside check); the workers now converge on the recorded source."""
    from types import SimpleNamespace

    from shmserve import state

    stack.wait_until(stack.all_ready, 60, "both frontends ready")
    with Load(stack, models["refs"]) as load:
        load.wait_for(10)
        state.update(SimpleNamespace(run_dir=stack.run_dir), lambda tree: tree["sources"].
                     __setitem__("tiny", {"source": str(models["b"]), "revision": "tiny-r4"}))
        stack.wait_until(lambda: revisions(stack) == [("ready", "tiny-r4", None)] * 2, 30,
                         "both workers to serve what the run state records")
        switched = time.monotonic()
        load.wait_for(20)
    outcomes = load.outcomes
    assert {o[1] for o in outcomes} == {"200"}, outcomes
    assert {o[3] for o in outcomes if o[0] > switched} == {"b"}
    assert {o[2] for o in outcomes if o[3] == "b"} == {"tiny-r4"}
    def switches() -> list[dict]:
        return [line for worker in ("worker-0", "worker-1") for line in stack.log_lines(worker)
                if line.get("message") == "worker.switched" and line.get("by") == "run_state"]
    # a worker's info lines reach its log within logging.flush_interval_ms (CI read one
    # worker's 0.1 s after it switched, before its flush)
    stack.wait_until(lambda: len(switches()) >= 2, 5, "both workers' switched lines")
    assert [line["revision"] for line in switches()] == ["tiny-r4"] * 2, switches()
    assert reconciles(stack) == {("0", "loaded"): 1, ("1", "loaded"): 1}  # and nothing else


def reconciles(stack: Stack) -> dict[tuple[str, str], float]:
    """shmserve_worker_reconciles_total of tiny by worker and outcome, the nonzero ones (each
    outcome's series exists at zero from the worker's start)."""
    from prometheus_client.parser import text_string_to_metric_families

    found, outcomes = {}, set()
    for family in text_string_to_metric_families(stack.get("/metrics")[2].decode()):
        for sample in family.samples:
            if sample.name == "shmserve_worker_reconciles_total" and \
                    sample.labels["model"] == "tiny":
                outcomes.add(sample.labels["outcome"])
                if sample.value:
                    found[(sample.labels["worker"], sample.labels["outcome"])] = sample.value
    assert outcomes == {"standby", "loaded", "failed"}, outcomes
    return found


@pytest.mark.parametrize("harm", ["deleted", "damaged"])
def test_a_worker_whose_recorded_source_broke_serves_the_config_and_a_reload_mends_it(
        stack, models, harm):
    """Served before: b (tiny-r4). After: b again, as tiny-r6 (damaged: tiny-r8). A reload's
    source deleted or damaged after the reload, then a worker restarted: it failed its start in
    a loop (damaged), or served the config's weights beside the other's reloaded ones, and a
    reload to a good source was refused, the deleted one read as another architecture, or
    because a worker was not ready (an outside check). Now it serves the config's weights,
    /admin/models says diverged, and a reload to a good source mends the model."""
    revision = {"deleted": "tiny-r5", "damaged": "tiny-r7"}[harm]
    mended = {"deleted": "tiny-r6", "damaged": "tiny-r8"}[harm]
    copy = models["root"] / harm
    shutil.copytree(models["b"], copy)
    stack.wait_until(stack.all_ready, 60, "both frontends ready")
    status, answer = reload(stack, "tiny", source=str(copy), revision=revision)
    assert status == 200, answer
    if harm == "deleted":
        shutil.rmtree(copy)
    else:  # every tensor byte 0xff (NaN), the header kept
        weights = copy / "model.safetensors"
        raw = bytearray(weights.read_bytes())
        start = 8 + int.from_bytes(raw[:8], "little")
        raw[start:] = b"\xff" * (len(raw) - start)
        weights.write_bytes(bytes(raw))
    old = stack.pid("workers:worker-1")
    os.kill(old, signal.SIGKILL)
    stack.wait_until(lambda: revisions(stack) == [("ready", revision, None),
                                                  ("diverged", "tiny-r1", None)], 90,
                     "worker-1 back on the config's weights, marked diverged")
    message = {"deleted": "worker.reloaded_source_gone",
               "damaged": "worker.reloaded_source_failed"}[harm]
    assert [line for line in stack.log_lines("worker-1") if line.get("message") == message]

    def ready() -> tuple[int, str, list]:
        code, _, raw = stack.get("/ready")
        body = json.loads(raw)
        return code, body["status"], [w["diverged"] for w in body["workers"]]
    # a probe keeps passing (every model is served), but says degraded, and which
    stack.wait_until(lambda: ready() == (200, "degraded", [[], ["tiny"]]), 10,
                     f"/ready degraded, naming the diverged model: {ready()}")
    if harm == "deleted":  # `shmserve status` names it too (it said "not every worker ready")
        def status() -> dict:  # through nginx: either frontend's view (exit 1: degraded)
            return json.loads(stack.cli("status", "--json", check=False).stdout)
        stack.wait_until(lambda: "worker 1 serving apart from the run state" in status()[
            "state_text"], 30, "status naming the worker")
        snapshot = status()
        assert snapshot["state"] == "degraded", snapshot
        assert [w["diverged"] for w in snapshot["workers"]] == [[], ["tiny"]]
    # (a frontend's /ready says degraded until it is mended: every worker ready is enough)
    stack.wait_until(stack.all_ready, 60, "both frontends ready")
    status, answer = reload(stack, "tiny", source=str(models["b"]), revision=mended)
    assert status == 200 and answer["revision"] == mended, answer
    settles_on(stack, mended)
    stack.wait_until(lambda: ready() == (200, "ready", [[], []]), 10, "/ready ready again")
