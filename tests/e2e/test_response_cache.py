"""frontends.response_cache_mb through nginx: a request whose every input a frontend answered
before, with the same weights, is answered without a worker; a hot reload's new weights are
never answered with the old rows; counted in /metrics and in Triton's statistics."""

from __future__ import annotations

import json

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TINY_MAX_TOKENS, tiny_overrides
from tests.stack import Stack
from tests.tinymodel import build_tiny_bert, reference_embeddings

TOKEN = "cache-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
TEXTS = ["the first text", "a second, longer text about shared memory"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("cache-models")
    other = build_tiny_bert(root / "other", seed=11, max_positions=TINY_MAX_TOKENS)
    # one frontend: every request meets the same cache
    overrides = tiny_overrides(tiny_model, frontends={"count": 1, "response_cache_mb": 1},
                               admin={"token": TOKEN})
    overrides["model_roots"].append(str(root))
    s = Stack(tmp_path_factory.mktemp("cache-stack"), overrides)
    s.other = other
    s.up()
    yield s
    s.down()


def counted(stack: Stack) -> dict[tuple, float]:
    _, _, raw = stack.get("/metrics")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(raw.decode()) for s in f.samples
            if s.name.startswith(("shmserve_response_cache", "shmserve_batch_texts_count"))}


def passes(stack: Stack) -> float:
    return sum(v for (name, _), v in counted(stack).items()
               if name == "shmserve_batch_texts_count")


def cache_count(stack: Stack, result: str) -> float:
    return counted(stack).get(("shmserve_response_cache_requests_total",
                               (("model", "tiny"), ("result", result))), 0.0)


def embed(stack: Stack, texts, **more) -> tuple[np.ndarray, dict, dict]:
    status, headers, body = stack.post_json("/v1/embeddings", {"model": "tiny", "input": texts,
                                                               **more})
    assert status == 200, body
    return np.array([d["embedding"] for d in body["data"]], np.float32), headers, body


def triton(stack: Stack) -> dict:
    _, _, raw = stack.get("/v2/models/tiny/stats")
    [stat] = json.loads(raw)["model_stats"]
    return stat


def test_a_repeated_request_is_answered_from_the_cache(stack, tiny_model):
    want = reference_embeddings(tiny_model, TEXTS, TINY_MAX_TOKENS)
    first, headers, _ = embed(stack, TEXTS)
    np.testing.assert_allclose(first, want, atol=1e-5)
    before, stats = (passes(stack), cache_count(stack, "hit")), triton(stack)
    again, headers_again, body = embed(stack, TEXTS)
    np.testing.assert_array_equal(again, first)  # the same rows, bit for bit
    assert body["revision"] == headers_again["X-Model-Revision"] == "tiny-r1"
    assert (passes(stack), cache_count(stack, "hit")) == (before[0], before[1] + 1)  # no pass
    lines: list[dict] = []

    def access_line() -> bool:
        lines[:] = [line for line in stack.log_lines("frontend-0")
                    if line.get("message") == "request"
                    and line.get("request_id") == headers_again["X-Request-ID"]]
        return bool(lines)

    stack.wait_until(access_line, 10, "the request's access line")
    assert lines[0]["cache"] == "hit" and lines[0]["status"] == 200, lines
    # Triton's statistics: a success and a cache hit, and no input run
    now = triton(stack)
    grew = {part: now["inference_stats"][part]["count"] - stats["inference_stats"][part][
        "count"] for part in ("success", "cache_hit", "cache_miss", "compute_infer")}
    assert grew == {"success": 1, "cache_hit": 1, "cache_miss": 0, "compute_infer": 0}
    assert now["inference_count"] == stats["inference_count"]
    # one of them alone (another request): held; with an input never sent: run whole, kept
    alone, _, _ = embed(stack, TEXTS[1])
    np.testing.assert_array_equal(alone, first[1:])
    misses, ran = cache_count(stack, "miss"), passes(stack)
    mixed, _, _ = embed(stack, [TEXTS[0], "a text never sent before"])
    np.testing.assert_array_equal(mixed[0], first[0])
    assert cache_count(stack, "miss") == misses + 1 and passes(stack) > ran
    # what else decides a row keys it too: a prompt, unnormalised rows
    prompted, _, _ = embed(stack, TEXTS, prompt_name="query")
    assert not np.allclose(prompted, first, atol=1e-3)
    status, _, raw = stack.post_json("/embed", {"model": "tiny", "inputs": TEXTS,
                                               "normalize": False})
    assert status == 200 and not np.allclose(np.array(raw, np.float32), first, atol=1e-3)
    held = counted(stack)[("shmserve_response_cache_bytes", (("frontend", "0"),))]
    assert 0 < held <= 1 << 20


def test_an_apply_of_the_dtype_is_not_answered_with_the_old_dtypes_rows(stack):
    """An apply of a model's dtype keeps its revision (the same weights): its rows are not
    answered from the caches, which it empties (it restarts the frontends too: they read the
    models' config); and back."""
    import yaml

    def serve_in(dtype: str) -> None:
        tree = yaml.safe_load(stack.config_file.read_text())
        tree["models"][0]["dtype"] = dtype
        stack.config_file.write_text(yaml.safe_dump(tree))
        stack.cli("apply", timeout=300)
        stack.wait_until(stack.all_ready, 90, f"the worker ready in {dtype}")
        _, _, raw = stack.get("/info")
        [info] = [m for m in json.loads(raw)["models"] if m["name"] == "tiny"]
        assert info["dtype"] == dtype, info

    first, headers, _ = embed(stack, TEXTS)
    embed(stack, TEXTS)  # held
    revision = headers["X-Model-Revision"]
    for dtype in ("bf16", "fp32"):
        serve_in(dtype)
        hits = cache_count(stack, "hit")  # (counted on across restarts)
        rows, headers, _ = embed(stack, TEXTS)
        assert headers["X-Model-Revision"] == revision and cache_count(stack, "hit") == hits
        if dtype == "bf16":
            assert not np.array_equal(rows, first)  # bf16's rows, not the fp32 ones held
        np.testing.assert_allclose(rows, first, atol=0.05 if dtype == "bf16" else 1e-6)
        again, _, _ = embed(stack, TEXTS)  # and held in their turn
        np.testing.assert_array_equal(again, rows)
        assert cache_count(stack, "hit") == hits + 1


def test_a_reload_is_never_answered_with_the_old_weights_rows(stack, tiny_model):
    first, _, _ = embed(stack, TEXTS)
    embed(stack, TEXTS)  # held
    status, _, raw = stack.request("POST", "/admin/models/tiny/reload", json.dumps(
        {"source": str(stack.other), "revision": "tiny-r2"}).encode(), ADMIN)
    assert status == 200, raw
    hits = cache_count(stack, "hit")
    after, headers, _ = embed(stack, TEXTS)
    assert headers["X-Model-Revision"] == "tiny-r2" and cache_count(stack, "hit") == hits
    np.testing.assert_allclose(after, reference_embeddings(stack.other, TEXTS,
                                                           TINY_MAX_TOKENS), atol=1e-5)
    again, headers, _ = embed(stack, TEXTS)  # the new weights' rows, held in their turn
    np.testing.assert_array_equal(again, after)
    assert cache_count(stack, "hit") == hits + 1 and headers["X-Model-Revision"] == "tiny-r2"

