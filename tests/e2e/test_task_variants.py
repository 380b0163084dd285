"""A/B splits, pinned models and dtypes through nginx, on the task stack (tests/e2e/conftest.py)
shared with test_tasks.py: which worker loads what, the arms' weights, stickiness, metrics and
versions, and new weights on every frontend."""

import asyncio
import json
from collections import Counter, defaultdict

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TINY_MAX_TOKENS
from tests.e2e.conftest import AB_WEIGHT_B
from tests.e2e.test_tasks import ADMIN, TEXTS
from tests.tinymodel import reference_embeddings


def admin_models(task_stack) -> dict:
    status, _, raw = task_stack.get("/admin/models", ADMIN)
    assert status == 200, raw
    return {m["name"]: m for m in json.loads(raw)["models"]}


def test_pinned_models_load_only_on_their_workers_and_dtypes_resolve(task_stack, task_dirs):
    from gpu_workers.device import cpu_has_bf16

    models = admin_models(task_stack)
    assert [w["worker"] for w in models["clf"]["workers"]] == [1]
    assert [w["worker"] for w in models["q8"]["workers"]] == [0]
    assert [w["worker"] for w in models["tiny"]["workers"]] == [0, 1]
    assert {(w["state"], w["revision"], w["standby"]) for w in models["clf"]["workers"]} == \
        {("ready", "clf-r1", None)}
    assert {w["dtype"] for w in models["q8"]["workers"]} == {"int8"}
    assert {w["dtype"] for w in models["auto"]["workers"]} == \
        {"bf16" if cpu_has_bf16() else "fp32"}
    assert [(w["worker"], w["dtype"]) for w in models["strict"]["workers"]] == [(0, "fp32")]
    # /info names the dtype the workers run, not the configured "auto".
    status, _, info = task_stack.get("/info")
    assert status == 200
    described = {m["name"]: m for m in json.loads(info)["models"]}
    dtypes = {name: m["dtype"] for name, m in described.items()}
    assert (dtypes["auto"], dtypes["strict"], dtypes["q8"]) == \
        ("bf16" if cpu_has_bf16() else "fp32", "fp32", "int8")
    # A scoring model has no pooling; a classifier names its labels.
    assert described["clf"]["pooling"] is None and described["clf"]["labels"]
    assert described["tiny"]["pooling"] == "mean"
    # Each model names the workers that load it (models.devices) and their state of it.
    assert described["clf"]["workers"] == [{"worker": 1, "state": "ready"}]
    assert described["ce-id"]["workers"] == [{"worker": 0, "state": "ready"}]
    assert described["tiny"]["workers"] == [{"worker": 0, "state": "ready"},
                                            {"worker": 1, "state": "ready"}]
    want = reference_embeddings(task_dirs["tiny"], TEXTS, TINY_MAX_TOKENS)
    for model, floor in (("q8", 0.99), ("auto", 0.99), ("strict", 0.99999)):
        status, _, body = task_stack.post_json("/predict", {"model": model, "texts": TEXTS})
        assert status == 200, body
        got = np.array(body["results"], dtype=np.float32)
        assert ((got * want).sum(1)).min() >= floor  # both sides are unit vectors


async def _embed_many(task_stack, bodies, headers=None, concurrency=32):
    """POST each body to /v1/embeddings; (variant, revision header, body revision, vector)."""
    async with aiohttp.ClientSession(task_stack.url) as session:
        gate = asyncio.Semaphore(concurrency)

        async def one(i, body):
            async with gate, session.post("/v1/embeddings", json=body,
                                          headers=headers(i) if headers else None) as resp:
                answer = await resp.json()
                assert resp.status == 200, answer
                return (resp.headers["X-Model-Variant"], resp.headers["X-Model-Revision"],
                        answer["revision"], answer["data"][0]["embedding"])

        return await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))


def test_ab_split_follows_the_weights_and_says_who_served(task_stack, task_dirs):
    n = 2000
    results = asyncio.run(_embed_many(task_stack, [{"model": "ab", "input": f"text {i % 7}"}
                                              for i in range(n)]))
    counts = Counter(r[0] for r in results)
    assert abs(counts["b"] / n - AB_WEIGHT_B) <= 0.03, counts
    refs = {"a": reference_embeddings(task_dirs["tiny"], [f"text {i}" for i in range(7)],
                                      TINY_MAX_TOKENS),
            "b": reference_embeddings(task_dirs["other"], [f"text {i}" for i in range(7)],
                                      TINY_MAX_TOKENS)}
    revision = {"a": "ab-r1", "b": "ab-r2"}
    for i, (variant, header, body_revision, vector) in enumerate(results):
        assert header == body_revision == revision[variant]
        np.testing.assert_allclose(vector, refs[variant][i % 7], atol=1e-5)
    _, _, raw = task_stack.get("/metrics")
    served = {s.labels["revision"]: s.value for f in text_string_to_metric_families(raw.decode())
              for s in f.samples if s.name == "shmserve_requests_total"
              and s.labels.get("model") == "ab" and s.labels["status"] == "200"}
    assert served["ab-r1"] >= counts["a"] and served["ab-r2"] >= counts["b"]
    # Triton's statistics: a version per arm, each with its own requests and passes (the
    # workers name an arm ab@a, ab@b)
    _, _, raw = task_stack.get("/v2/models/ab/stats")
    stats = {s["version"]: s for s in json.loads(raw)["model_stats"]}
    assert sorted(stats) == ["ab-r1", "ab-r2"]
    for variant, version in revision.items():
        assert stats[version]["inference_stats"]["success"]["count"] >= counts[variant]
        assert stats[version]["inference_count"] >= counts[variant]
        assert sum(b["batch_size"] * b["compute_infer"]["count"]
                   for b in stats[version]["batch_stats"]) >= counts[variant]


def inference_metrics(task_stack, model: str) -> dict:
    """shmserve_inference_requests_total of `model` by (variant, priority, status), and its
    latency histogram's counts by ("seconds", variant, priority, status)."""
    out = {}
    _, _, raw = task_stack.get("/metrics")
    for family in text_string_to_metric_families(raw.decode()):
        for s in family.samples:
            if s.labels.get("model") != model:
                continue
            if s.name == "shmserve_inference_requests_total":
                out[s.labels["variant"], s.labels["priority"], s.labels["status"]] = s.value
            elif s.name == "shmserve_inference_request_duration_seconds_count":
                out["seconds", s.labels["variant"], s.labels["priority"],
                    s.labels["status"]] = s.value
    return out


def test_inference_metrics_name_each_arm_and_priority(task_stack):
    """An A/B test compares its arms' latency and errors, and priorities are there to keep
    interactive requests fast: the request metrics had neither label (an outside check)."""
    before = inference_metrics(task_stack, "ab")
    for header in ("user-1", "user-2", "user-3", "user-4"):
        for priority in ("high", "low"):
            status, headers, _ = task_stack.post_json(
                "/v1/embeddings", {"model": "ab", "input": "x"},
                {"X-User": header, "X-Priority": priority})
            assert status == 200
    def counted_all(now: dict) -> bool:  # (Stack.settled: a scrape may precede the last)
        return sum(n - before.get(k, 0) for k, n in now.items() if len(k) == 3) >= 8
    after = task_stack.settled(lambda: inference_metrics(task_stack, "ab"), counted_all)
    grew = {key: after[key] - before.get(key, 0) for key in after
            if after[key] != before.get(key, 0)}
    counted = {key: n for key, n in grew.items() if len(key) == 3}
    assert sum(counted.values()) == 8 and {k[2] for k in counted} == {"200"}, grew
    assert {k[1] for k in counted} == {"1", "-1"} and {k[0] for k in counted} <= {"a", "b"}
    timed = {key[1:]: n for key, n in grew.items() if len(key) == 4}
    assert timed == counted, grew


def test_a_malformed_request_is_not_counted_by_arm(task_stack):
    """A request refused for its own body once its arm was chosen (dimensions past the model's
    width, token ids outside the vocabulary, an unknown prompt) is in shmserve_requests_total
    only: an arm's error ratio counts the server's errors (docs/observability.md). They were
    counted there with their 400 and 422 (an outside check)."""
    before = inference_metrics(task_stack, "ab")
    for path, body in (("/v1/embeddings", {"model": "ab", "input": "x", "dimensions": 99999}),
                       ("/v1/embeddings", {"model": "ab", "input": [[1, 2, 3]]}),
                       ("/embed", {"model": "ab", "inputs": "x", "prompt_name": "nope"}),
                       ("/embed", {"model": "ab", "inputs": "x", "dimensions": 99999})):
        status, _, answer = task_stack.post_json(path, body)
        assert status in (400, 422), answer
    assert inference_metrics(task_stack, "ab") == before


def test_a_sticky_key_never_flips(task_stack):
    keys = [f"user-{k}" for k in range(40)]
    seen = defaultdict(set)
    for field in ("header", "user"):
        bodies, model = [], "ab" if field == "header" else "ab-user"
        for round_ in range(10):
            bodies += [{"model": model, "input": f"r{round_}",
                        **({"user": k} if field == "user" else {})} for k in keys]
        results = asyncio.run(_embed_many(
            task_stack, bodies, headers=(lambda i: {"X-User": keys[i % 40]}) if field == "header"
            else None))
        for i, result in enumerate(results):
            seen[(field, keys[i % 40])].add(result[0])
        assert all(len(v) == 1 for v in seen.values()), seen  # never flips
        assert {next(iter(v)) for (f, _), v in seen.items() if f == field} == {"a", "b"}


def test_an_empty_sticky_key_is_no_key(task_stack):
    """A sticky key's header sent empty (or a body's user empty, or whitespace) splits by the
    weights as a request without one: it was the key "", so all such requests went to one arm
    (an outside check)."""
    n = 400
    for model, field, share in (("ab", "header", AB_WEIGHT_B), ("ab-user", "user", 0.5)):
        blanks = ["", "  "]
        bodies = [{"model": model, "input": f"blank {i % 7}",
                   **({"user": blanks[i % 2]} if field == "user" else {})} for i in range(n)]
        results = asyncio.run(_embed_many(
            task_stack, bodies, headers=(lambda i: {"X-User": blanks[i % 2]})
            if field == "header" else None))
        counts = Counter(r[0] for r in results)
        assert abs(counts["b"] / n - share) <= 0.1, (model, counts)


def test_new_weights_apply_on_every_frontend(task_stack):
    status, _, body = task_stack.request("PUT", "/admin/models/ab/split",
                                    json.dumps({"weights": {"a": 0, "b": 1}}).encode(), ADMIN)
    assert status == 200, body
    results = asyncio.run(_embed_many(task_stack, [{"model": "ab", "input": "x"}] * 100))
    assert {r[0] for r in results} == {"b"}  # two frontends, both already on the new weights
    assert [v["weight"] for v in admin_models(task_stack)["ab"]["variants"]] == [0, 1]
    # /info says so too, without the admin token (an outside check: admin only)
    info = {m["name"]: m for m in json.loads(task_stack.get("/info")[2])["models"]}
    assert [v["weight"] for v in info["ab"]["variants"]] == [0, 1]
    assert (info["ab"]["sticky_key"], info["ab-user"]["sticky_key"]) == ("header:X-User",
                                                                        "user")
    for bad, why in (({"weights": {"a": 1}}, "b missing"),
                     ({"weights": {"a": 0, "b": 0}}, "all are 0"),
                     ({"w": 1}, "give an object {variant: weight}"),
                     ({"weights": {"a": 1, "b": 1, "c": 1}}, "no variant c"),
                     ({"weights": {"a": 1, "c": 1}}, "b missing; no variant c"),  # b misspelt
                     ({"weights": {"a": -1, "b": 2}}, "a: -1 is not a number from 0 to 1e+09"),
                     ({"weights": {"a": "1", "b": 2}}, 'a: "1" is not a number from 0 to 1e+09'),
                     # as the client wrote them, not Python's reprs (True, 10000000000.0)
                     ({"weights": {"a": True, "b": 2}}, "a: true is not a number from 0 to 1e+09"),
                     ({"weights": {"a": 1e10, "b": 2}}, "a: 1e+10 is not a number from 0 to 1e+09"),
                     # Each finite, their sum not: it routed every request to one arm.
                     ({"weights": {"a": 1e308, "b": 1e308}}, "a: 1e+308 is not a number from 0 "
                      "to 1e+09")):
        status, _, raw = task_stack.request("PUT", "/admin/models/ab/split",
                                       json.dumps(bad).encode(), ADMIN)
        error = json.loads(raw)["error"]
        assert status == 422 and error["param"] == "weights", raw
        assert error["message"].endswith(why), raw
    status, _, raw = task_stack.request("POST", "/admin/models/ab/reload",
                                   json.dumps({"variant": "zz"}).encode(),
                                   {**ADMIN, "X-Request-ID": "reload-zz"})
    assert status == 422 and "has no variant 'zz'; its variants are a, b" in raw.decode()
    # the access lines name the model, a split set or a reload refused (they said "")
    status, _, _ = task_stack.request("PUT", "/admin/models/ab/split", json.dumps(
        {"weights": {"a": 0, "b": 1}}).encode(), {**ADMIN, "X-Request-ID": "split-set"})
    assert status == 200
    for request_id in ("reload-zz", "split-set"):
        [line] = task_stack.settled(
            lambda: [line for program in ("frontend-0", "frontend-1")
                     for line in task_stack.log_lines(program, whole=True)
                     if line.get("request_id") == request_id],
            lambda found: len(found) == 1)
        assert line["model"] == "ab", line
    status, _, raw = task_stack.request("POST", "/admin/models/ab/reload", b"{}", ADMIN)
    assert status == 422 and "one of a, b ('variant' in the body, `shmserve reload " \
        "--variant`)" in json.loads(raw)["error"]["message"], raw
    # Arm b reloaded under arm a's revision could no longer be told apart from it (metrics,
    # KServe's versions): refused before any worker loads anything.
    status, _, raw = task_stack.request("POST", "/admin/models/ab/reload", json.dumps(
        {"variant": "b", "revision": "ab-r1"}).encode(), ADMIN)
    error = json.loads(raw)["error"]
    assert status == 422 and error["param"] == "revision", raw
    assert "variant 'a' of 'ab' serves revision 'ab-r1'" in error["message"]
    status, _, _ = task_stack.request("PUT", "/admin/models/tiny/split",
                                 json.dumps({"weights": {"": 1}}).encode(), ADMIN)
    assert status == 422
    # A malformed body is a 400 before what the model lacks (it was the 422 "has no variants")
    status, _, raw = task_stack.request("PUT", "/admin/models/tiny/split", b"{", ADMIN)
    assert status == 400, raw
    assert task_stack.request("PUT", "/admin/models/ab/split", b"{}")[0] == 401
    # The CLI sets them back, through nginx with the configured token.
    proc = task_stack.cli("split", "ab", f"a={1 - AB_WEIGHT_B}", f"b={AB_WEIGHT_B}")
    assert json.loads(proc.stdout)["weights"] == {"a": 1 - AB_WEIGHT_B, "b": AB_WEIGHT_B}
    results = asyncio.run(_embed_many(task_stack, [{"model": "ab", "input": "x"}] * 100))
    assert Counter(r[0] for r in results)["a"] >= 60


def test_ab_models_are_ready_and_versioned_on_kserve_and_info(task_stack):
    """Workers name A/B arms MODEL@VARIANT; KServe readiness and /info still find the model."""
    import tritonclient.http as triton

    client = triton.InferenceServerClient(task_stack.url.removeprefix("http://"))
    assert client.is_model_ready("ab")
    assert client.get_model_metadata("ab")["versions"] == ["ab-r1", "ab-r2"]  # one per arm
    # A version in the path pins the request to the arm that serves it, whatever the split's
    # weights (b has 0.2 here); the reply names the revision that computed it.
    for version in ("ab-r1", "ab-r2"):
        text = triton.InferInput("text", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"pinned"], dtype=object))
        for _ in range(5):
            reply = client.infer("ab", [text], model_version=version).get_response()
            assert reply["model_version"] == version
    with pytest.raises(triton.InferenceServerException, match="it serves 'ab-r1', 'ab-r2'"):
        client.get_model_metadata("ab", model_version="ab-r9")
    client.close()
    status, _, raw = task_stack.get("/info")
    models = {m["name"]: m for m in json.loads(raw)["models"]}
    assert status == 200 and models["ab"]["revision"] == "ab-r1"
    both = [{"worker": 0, "state": "ready"}, {"worker": 1, "state": "ready"}]
    assert models["ab"]["variants"] == [
        {"name": "a", "revision": "ab-r1", "weight": pytest.approx(1 - AB_WEIGHT_B),
         "workers": both},
        {"name": "b", "revision": "ab-r2", "weight": pytest.approx(AB_WEIGHT_B),
         "workers": both}]
    assert "variants" not in models["tiny"]


def test_a_rolling_worker_restart_warns_of_the_models_one_worker_loads(task_stack):
    """clf, ce-hot, distil and qwen3 load on worker 1 only, ce-id, q8 and strict on worker 0
    only: the restart says so (it did not, and requests for them were 503 while their worker
    restarted), then serves them again."""
    done = task_stack.cli("restart", "worker-1", timeout=300)
    assert "warning: some models have no other worker (ce-hot, clf, distil, qwen3 only on " \
        "worker-1)" in done.stderr, done.stderr
    assert "worker-1 ready" in done.stdout
    status, _, body = task_stack.post_json("/v1/classify", {"model": "clf", "input": ["x"]})
    assert status == 200, body
