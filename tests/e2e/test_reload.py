"""Hot reload through nginx under continuous load, on two workers and two frontends.

The tests share one stack and run in file order: each starts from the revision the previous one
left (`served`), and says so.
"""

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from shmserve.models import weights_digest
from tests.conftest import TINY_MAX_TOKENS, tiny_overrides
from tests.load import Load as ClosedLoop
from tests.stack import Stack
from tests.tinymodel import build_tiny_bert, reference_embeddings

TOKEN = "reload-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
# More texts than batching.max_batch_size (16): every request spans several batches.
TEXTS = [f"request text number {i} " + "word " * (i % 9) for i in range(20)]


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("reload-models")
    b = build_tiny_bert(root / "b", seed=7, max_positions=TINY_MAX_TOKENS)
    return {"root": root, "a": tiny_model, "b": b,
            "refs": {"a": reference_embeddings(tiny_model, TEXTS, TINY_MAX_TOKENS),
                     "b": reference_embeddings(b, TEXTS, TINY_MAX_TOKENS)}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, models):
    # Heartbeats 2 s apart: what a frontend knows of a reload it did not see must come at
    # once (a worker's announcement), not at the next heartbeat.
    overrides = tiny_overrides(models["a"], admin={"token": TOKEN}, workers={
        "cpu_workers": 2, "heartbeat_interval_s": 2.0, "heartbeat_timeout_s": 8.0})
    overrides["model_roots"].append(str(models["root"]))
    s = Stack(tmp_path_factory.mktemp("reload-stack"), overrides)
    s.up()
    yield s
    s.down()


class Load(ClosedLoop):
    """Closed-loop clients posting TEXTS; each outcome records when it started, its status, the
    revision it reports and which model's vectors it holds ("a", "b", or "mixed")."""

    def __init__(self, stack: Stack, refs: dict, clients: int = 4) -> None:
        super().__init__(stack, clients)
        self.refs = refs

    def body(self, client: int, n: int) -> bytes:
        return json.dumps({"texts": TEXTS}).encode()

    def outcome(self, resp, started: float) -> tuple[float, str, str, str]:
        body = json.loads(resp.read())
        assert resp.headers["X-Model-Revision"] == body["revision"]
        return (started, str(resp.status), body["revision"],
                self._which(np.array(body["results"], dtype=np.float32)))

    def failure(self, status: str, started: float) -> tuple[float, str, str, str]:
        return (started, status, "", "")

    def _which(self, rows: np.ndarray) -> str:
        for name, ref in self.refs.items():
            if np.allclose(rows, ref, atol=1e-5):
                return name
        return "mixed"


def reload(stack: Stack, name: str, **body) -> tuple[int, dict]:
    status, _, raw = stack.request("POST", f"/admin/models/{name}/reload",
                                   json.dumps(body).encode(), ADMIN)
    return status, json.loads(raw)


def revisions(stack: Stack) -> list[tuple[str, str, str | None]]:
    _, _, raw = stack.get("/admin/models", ADMIN)
    [model] = json.loads(raw)["models"]
    return [(w["state"], w["revision"], w["standby"]) for w in model["workers"]]


def heard(stack: Stack, program: str, message: str, worker: int | None = None) -> list[float]:
    """When `program` logged `message` (about `worker`), in seconds of the day."""
    def seconds(stamp: str) -> float:
        h, m, sec = stamp.rstrip("Z").partition("T")[2].split(":")
        return int(h) * 3600 + int(m) * 60 + float(sec)
    return [seconds(line["time"]) for line in stack.log_lines(program)
            if line.get("message") == message and worker in (None, line.get("worker"))]


def info_revision(stack: Stack, frontend: int) -> str:
    """The model's revision in GET /info, from one frontend (its socket, not nginx)."""
    from shmserve.remote import get_unix

    _, raw = get_unix(str(stack.run_dir / "sockets" / f"frontend-{frontend}.sock"), "/info")
    return json.loads(raw)["models"][0]["revision"]


def settles_on(stack: Stack, revision: str) -> None:
    """GET /admin/models shows `revision` ready on both workers (it reads heartbeats, so it may
    lag the reload call's answer by a heartbeat interval)."""
    stack.wait_until(lambda: revisions(stack) == [("ready", revision, None)] * 2, 10,
                     f"both workers to report {revision} ready")


def test_reload_under_load_switches_every_worker_without_a_failure(stack, models):
    """Served before: a (tiny-r1). After: b (tiny-r2)."""
    assert revisions(stack) == [("ready", "tiny-r1", None)] * 2
    with Load(stack, models["refs"]) as load:
        load.wait_for(20)
        status, answer = reload(stack, "tiny", source=str(models["b"]), revision="tiny-r2")
        switched = time.monotonic()
        # What every frontend says right after the answer: a frontend read the revisions from
        # the workers' heartbeats, and /info and KServe's model version lagged the reload by up
        # to workers.heartbeat_interval_s (an outside check read the old one)
        seen_at_once = [info_revision(stack, index) for index in (0, 1)]
        assert status == 200, answer
        load.wait_for(40)
    assert answer["revision"] == "tiny-r2" and [w["ok"] for w in answer["workers"]] == [1, 1]
    assert seen_at_once == ["tiny-r2"] * 2  # both frontends, the one not asked too
    outcomes = load.outcomes
    assert {o[1] for o in outcomes} == {"200"}, outcomes  # zero failed requests
    # Every response holds exactly one revision's vectors, all rows, and says which.
    assert {(o[2], o[3]) for o in outcomes} <= {("tiny-r1", "a"), ("tiny-r2", "b")}
    assert any(o[3] == "a" for o in outcomes)
    assert {o[3] for o in outcomes if o[0] > switched} == {"b"}  # after the switch: only b
    settles_on(stack, "tiny-r2")
    # Each worker loaded on a thread nicer than its serving one (workers.reload_nice)
    loads = stack.logged(("worker-0", "worker-1"), "worker.reload_loading", 2)
    assert [line["nice"] for line in loads] == [10, 10], loads
    _, _, raw = stack.get("/admin/models", ADMIN)
    [model] = json.loads(raw)["models"]
    assert [w["loader"] for w in model["workers"]] == ["shmserve"] * 2, model
    # ... and each says what loaded the new weights, as a start's worker.loaded does.
    staged = stack.logged(("worker-0", "worker-1"), "worker.reload_staged", 2)
    assert [(line["loader"], line["revision"]) for line in staged] == [
        ("shmserve", "tiny-r2")] * 2, staged
    for worker in ("worker-0", "worker-1"):
        (loaded,) = [line for line in stack.log_lines(worker)
                     if line.get("message") == "worker.loaded"]
        assert loaded["loader"] == "shmserve", loaded
    # ... and loaded at its start on one too, the model thread serving at its own priority.
    for worker in ("worker-0", "worker-1"):
        (start,) = [line for line in stack.log_lines(worker)
                    if line.get("message") == "worker.loading"]
        assert start["nice"] == 10
        pid = stack.pid(f"workers:{worker}")
        assert int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16]) == 0


@pytest.mark.parametrize("damage,needle", [
    # refused before transformers is imported (it was its "cannot load", after seconds)
    ("corrupt", "not a readable safetensors file"),
    ("missing", "no model.safetensors"),
    # a wider model's weights: transformers' message pointed to a table in the worker's log
    ("wider", "does not fit its config.json (bert, hidden_size 32): tensors of other shapes"),
])
def test_a_failed_reload_under_load_keeps_the_old_revision(stack, models, tmp_path, damage,
                                                           needle):
    """Served before and after: b (tiny-r2)."""
    broken = models["root"] / f"broken-{damage}"
    shutil.copytree(models["b"], broken)
    weights = broken / "model.safetensors"
    if damage == "corrupt":
        weights.write_bytes(b"\xff" * 8 + os.urandom(4096))  # a header length past the file
    elif damage == "wider":
        wide = build_tiny_bert(tmp_path / "wide", hidden=48, max_positions=TINY_MAX_TOKENS)
        shutil.copy(wide / "model.safetensors", weights)
    else:
        weights.unlink()
    with Load(stack, models["refs"]) as load:
        load.wait_for(10)
        status, answer = reload(stack, "tiny", source=str(broken), revision="tiny-bad")
        load.wait_for(20)
    assert status == 422, answer
    message = answer["error"]["message"]
    assert needle in message and "the served revision is unchanged" in message, message
    assert "worker 0" in message and "worker 1" in message
    assert {(o[1], o[2], o[3]) for o in load.outcomes} == {("200", "tiny-r2", "b")}
    settles_on(stack, "tiny-r2")


def test_reload_refuses_what_it_must_not_load(stack, models, tmp_path):
    """Served before and after: b (tiny-r2)."""
    pickled = models["root"] / "pickled"
    pickled.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(models["b"] / name, pickled / name)
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    other_tokenizer = models["root"] / "other-tokenizer"
    shutil.copytree(models["b"], other_tokenizer)
    (other_tokenizer / "tokenizer.json").write_text(
        (other_tokenizer / "tokenizer.json").read_text().replace('"[UNK]"', '"[UNKNOWN]"'))
    outside = build_tiny_bert(tmp_path / "outside", max_positions=TINY_MAX_TOKENS)
    for source, needle in ((str(pickled), "safetensors only"),
                           (str(outside), "outside the model roots"),
                           (str(other_tokenizer), "tokenizer.json differs"),
                           ("package:no_such_model_pkg", "not installed"),
                           # a NUL was a 500 (ValueError: embedded null byte), an outside check
                           ("models/ce\u0000", "control character"),
                           # a name too long for the file system was a 500 echoing it whole,
                           # a ~user of no user a 500; one longer than a path can be is
                           # refused before the workers (they logged all 100 KB of it)
                           ("a" * 256, "File name too long"),
                           ("~no-such-user-49/m", "Could not determine home directory"),
                           ("/" + "q" * 100_000, "a model source is at most 4096"),
                           ("a/" * 3000, "a model source is at most 4096")):
        status, answer = reload(stack, "tiny", source=source)
        assert status == 422 and needle in answer["error"]["message"], answer
        assert answer["error"]["param"] == "source" and len(answer["error"]["message"]) < 900
    assert reload(stack, "nope")[0] == 404
    assert reload(stack, "tiny", variant="a")[0] == 422  # a model without variants
    # A label that cannot be a header value (it was accepted, and every request for the model
    # then failed in the frontend and got nginx's 502).
    for revision in ("a\nb", "r\u00e9", "two words"):
        status, answer = reload(stack, "tiny", revision=revision)
        assert status == 422 and answer["error"]["param"] == "revision", answer
        assert "visible ASCII" in answer["error"]["message"]
    status, _, _ = stack.request("POST", "/admin/models/tiny/reload", b"{}",
                                 {"Content-Type": "application/json"})
    assert status == 401
    settles_on(stack, "tiny-r2")


def test_of_two_reloads_at_once_one_goes_ahead(stack, models):
    """Served before and after: b (tiny-r2). Two admin calls at the same moment, through nginx
    to either frontend: one reloads, the other is refused at once (409); never both refused
    for each other's standby slots, with nothing reloaded."""
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: reload(stack, "tiny", source=str(models["b"]),
                                                 revision="tiny-r2"), range(2)))
    assert sorted(status for status, _ in answers) == [200, 409], answers
    refused = next(answer for status, answer in answers if status == 409)
    assert "a reload of tiny is already in progress" in refused["error"]["message"]
    settles_on(stack, "tiny-r2")


def reload_counts(stack: Stack) -> tuple[dict[str, float], float]:
    """shmserve_reloads_total of tiny by outcome, and its reload durations' count (every
    frontend's, as any frontend's /metrics gives them)."""
    from prometheus_client.parser import text_string_to_metric_families

    outcomes, timed = {}, 0.0
    for family in text_string_to_metric_families(stack.get("/metrics")[2].decode()):
        for sample in family.samples:
            if sample.labels.get("model") != "tiny":
                continue
            if sample.name == "shmserve_reloads_total":
                outcomes[sample.labels["outcome"]] = sample.value
            elif sample.name == "shmserve_reload_duration_seconds_count":
                timed = sample.value
    return outcomes, timed


def test_reloads_are_counted_by_outcome_and_timed(stack, models, tmp_path):
    """Served before and after: b (tiny-r2). A reload showed in the metrics only as an admin
    request (an outside check): each is counted by outcome, a success timed."""
    before, timed_before = reload_counts(stack)
    assert reload(stack, "tiny", source=str(models["b"]), revision="tiny-r2")[0] == 200
    broken = shutil.copytree(models["b"], tmp_path / "broken")
    (broken / "model.safetensors").unlink()
    assert reload(stack, "tiny", source=str(broken), revision="tiny-x")[0] == 422
    after, timed_after = stack.settled(  # (Stack.settled: a scrape may precede the last)
        lambda: reload_counts(stack),
        lambda now: now[0].get("invalid_request", 0) > before.get("invalid_request", 0))
    assert after.get("ok", 0) - before.get("ok", 0) == 1, (before, after)
    assert after.get("invalid_request", 0) - before.get("invalid_request", 0) == 1
    assert timed_after - timed_before == 1
    settles_on(stack, "tiny-r2")


def test_cli_reload_and_a_restarted_worker_loads_the_reloaded_model(stack, models):
    """Served before: b (tiny-r2). After: a, labelled tiny-r3, also on a restarted worker."""
    proc = stack.cli("reload", "tiny", str(models["a"]), "--revision", "tiny-r3")
    assert json.loads(proc.stdout)["revision"] == "tiny-r3"
    assert proc.stderr.startswith("shmserve: reloading tiny: every worker"), proc.stderr
    old = stack.pid("workers:worker-1")
    os.kill(old, signal.SIGKILL)
    stack.wait_until(lambda: stack.pid("workers:worker-1") not in (0, old),
                     60, "supervisord to restart worker-1")
    stack.wait_until(stack.all_ready, 90,
                     "every worker ready again, to both frontends")
    # Each frontend heard it ready at once (the worker announces it), not at its next ping:
    # /ready, judged by each frontend, said ready from one and not from the other for up to a
    # heartbeat interval (2 s here), as nginx alternated probes (an outside check).
    # (Lines reach the files up to logging's flush interval late: wait for this start's.)
    new = stack.pid("workers:worker-1")
    stack.wait_until(lambda: any(line.get("message") == "worker.ready" and line["pid"] == new
                                 for line in stack.log_lines("worker-1")), 10, "its ready line")
    ready_at = heard(stack, "worker-1", "worker.ready")[-1]
    stack.wait_until(lambda: all(heard(stack, f"frontend-{i}", "frontend.worker_ready", 1)[-1]
                                 > ready_at - 1 for i in (0, 1)), 10, "both frontends' lines")
    lags = [round(heard(stack, f"frontend-{i}", "frontend.worker_ready", 1)[-1] - ready_at, 3)
            for i in (0, 1)]
    assert all(lag < 0.5 for lag in lags), lags
    settles_on(stack, "tiny-r3")
    for _ in range(6):  # whichever worker serves, it serves a as tiny-r3
        status, _, body = stack.post_json("/predict", {"texts": TEXTS})
        assert status == 200 and body["revision"] == "tiny-r3"
        np.testing.assert_allclose(body["results"], models["refs"]["a"], atol=1e-5)
    # The CLI reports a refused reload and exits 1. The frontend that takes the call may not
    # have seen the restarted worker's heartbeat yet (GET /ready was answered by another one);
    # then it refuses for that reason, rightly, and the call is made again.
    def refused_for_its_source() -> bool:
        proc = stack.cli("reload", "tiny", "package:no_such_model_pkg", check=False)
        assert proc.returncode == 1 and not proc.stdout, proc.stdout  # the error: on stderr
        if "are not ready" in proc.stderr:
            return False
        assert "not installed" in proc.stderr, proc.stderr
        return True
    stack.wait_until(refused_for_its_source, 30, "the reload refused for its source")
    # A model or arm the deployment does not serve: the stack's answer at once, without the
    # line saying the command waits for every worker (it was printed before the 404).
    for extra in (["nope"], ["tiny", "--variant", "a"]):
        proc = stack.cli("reload", *extra[:1], str(models["a"]), *extra[1:], check=False)
        assert proc.returncode == 1 and not proc.stdout, proc.stdout
        assert json.loads(proc.stderr)["error"]["message"], proc.stderr


def test_admin_models_shows_the_revision_a_reload_is_loading(stack, models):
    """Served before: a (tiny-r3). After: a deeper model, labelled with its weights' digest (no
    revision given). While the workers load it, GET /admin/models shows that digest as their
    standby, the revision they will serve it as; it showed null until the weights were staged
    (the workers took the digest only once they had loaded them)."""
    # Six layers with a wide feed-forward, the width kept: compatible, and its load and
    # warm-up last about a second, several heartbeats.
    deep = build_tiny_bert(models["root"] / "deep", seed=11, layers=6, intermediate=4096,
                           max_positions=TINY_MAX_TOKENS)
    digest = weights_digest(deep / "model.safetensors")
    stack.wait_until(stack.all_ready, 30, "both frontends to see both "
                     "workers ready")
    for body in ({"source": str(deep)}, {}):  # a new source; the current one, read again
        seen, done = [], threading.Event()

        def watch() -> None:
            while not done.is_set():
                seen.extend(revisions(stack))

        with ThreadPoolExecutor(1) as pool:
            watching = pool.submit(watch)
            status, answer = reload(stack, "tiny", **body)
            done.set()
            watching.result()
        assert status == 200 and answer["revision"] == digest, answer
        assert {standby for state, _, standby in seen if state == "loading"} == {digest}, seen
        settles_on(stack, digest)
