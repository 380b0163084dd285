"""Every task, dtype, A/B split and pinning through nginx, on one stack of tiny models built here
and checked against the same models run directly in transformers."""

import asyncio
import json
from collections import Counter, defaultdict

import aiohttp
import msgpack
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TINY_MAX_TOKENS
from tests.e2e.conftest import AB_WEIGHT_B, LABELS, TOKEN
from tests.tinymodel import reference_embeddings, reference_scores, reference_splade

ADMIN = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello",
         "Shared memory moves token ids between processes without copies.",
         "An embedding is a vector that represents a piece of text."]


def admin_models(task_stack) -> dict:
    status, _, raw = task_stack.get("/admin/models", ADMIN)
    assert status == 200, raw
    return {m["name"]: m for m in json.loads(raw)["models"]}


def test_classify_is_the_softmax_of_the_classifier(task_stack, task_dirs):
    want = reference_scores(task_dirs["clf"], TEXTS, TINY_MAX_TOKENS)
    status, headers, body = task_stack.post_json("/v1/classify", {"model": "clf", "input": TEXTS,
                                                             "top_k": 2})
    assert status == 200, body
    assert (body["model"], body["revision"], headers["X-Model-Revision"]) == \
        ("clf", "clf-r1", "clf-r1")
    got = np.array([d["probs"] for d in body["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, want, atol=1e-5)
    for row, item in zip(want, body["data"]):
        best = np.argsort(-row)
        assert item["label"] == LABELS[best[0]] and item["num_classes"] == 3
        assert [x["label"] for x in item["labels"]] == [LABELS[i] for i in best[:2]]
    assert body["usage"]["total_tokens"] > 4
    # A bare string, no top_k: every label; the model is found without naming it.
    status, _, body = task_stack.post_json("/v1/classify", {"input": TEXTS[0]})
    assert status == 200 and len(body["data"]) == 1 and len(body["data"][0]["labels"]) == 3
    # /predict on a classification model answers label lists, best first.
    status, _, body = task_stack.post_json("/predict", {"model": "clf", "texts": TEXTS[:2],
                                                   "top_k": 1})
    assert status == 200, body
    assert [[x["label"] for x in r] for r in body["results"]] == \
        [[LABELS[int(np.argmax(w))]] for w in want[:2]]
    np.testing.assert_allclose([r[0]["score"] for r in body["results"]], want[:2].max(1),
                               atol=1e-5)


def test_classify_takes_pairs_as_an_nli_classifier_reads_them(task_stack, task_dirs):
    """A zero-shot NLI classifier reads a premise and a hypothesis as one pair (token types,
    one separator): /v1/classify takes pairs beside texts; it refused them (an outside check:
    only TEI's /predict took pairs)."""
    pairs = [("A man is eating food.", "Someone eats."), ("hello", "shared memory")]
    want = reference_scores(task_dirs["clf"], [*pairs, TEXTS[0]], TINY_MAX_TOKENS)
    status, _, body = task_stack.post_json("/v1/classify", {
        "model": "clf", "input": [list(p) for p in pairs] + [TEXTS[0]]})
    assert status == 200, body
    np.testing.assert_allclose([d["probs"] for d in body["data"]], want, atol=1e-5)
    assert body["usage"]["prompt_tokens"] > sum(len(a.split()) + len(b.split())
                                                for a, b in pairs)
    for bad in ([["one"]], [["a", "b", "c"]], [["a", 1]], ["a", {"text": "b"}]):
        status, _, body = task_stack.post_json("/v1/classify", {"model": "clf", "input": bad})
        assert status == 422 and "pair [first, second]" in body["error"]["message"], body


def test_rerank_scores_pairs_best_first(task_stack, task_dirs):
    query = "what moves token ids between processes?"
    docs = TEXTS + ["word " * 80]  # the last pair is cut to the model's 64 tokens
    want = reference_scores(task_dirs["ce"], [(query, d) for d in docs], TINY_MAX_TOKENS)
    body_docs = [docs[0], {"text": docs[1]}, *docs[2:]]  # Cohere/Jina document objects too
    status, headers, body = task_stack.post_json("/v1/rerank", {
        "model": "ce", "query": query, "documents": body_docs, "return_documents": True})
    assert status == 200, body
    assert headers["X-Model-Revision"] == body["revision"] == "ce-r1"
    results = body["results"]
    assert [r["index"] for r in results] == np.argsort(-want, kind="stable").tolist()
    np.testing.assert_allclose([r["relevance_score"] for r in results],
                               want[[r["index"] for r in results]], atol=1e-5)
    assert all(r["document"] == {"text": docs[r["index"]]} for r in results)
    status, _, body = task_stack.post_json("/v1/rerank", {"query": query, "documents": docs,
                                                     "top_n": 2})
    assert status == 200 and [r["index"] for r in body["results"]] == \
        [r["index"] for r in results[:2]]
    assert "document" not in body["results"][0]


def test_architectures_other_than_berts_serve_as_sentence_transformers(task_stack, task_dirs):
    """MPNet (all-mpnet-base-v2's architecture), an ELECTRA cross-encoder (ms-marco-electra's),
    a ModernBERT embedder and a DeBERTa-v3 cross-encoder (mxbai-rerank-v1's), built by
    gpu_workers.bert, .modernbert or .deberta and packed, a Qwen3 decoder pooled on its last
    token (gpu_workers.qwen3, packed), and a DistilBERT that transformers loads, through
    nginx. (A worker once refused
    MPNet and DeBERTa at load: SDPA asked of every model, an outside check.)"""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.cross_encoder import CrossEncoder

    for name in ("mpnet", "modernbert", "qwen3", "distil"):
        status, _, body = task_stack.post_json("/v1/embeddings", {"model": name, "input": TEXTS})
        assert status == 200, body
        got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
        want = SentenceTransformer(str(task_dirs[name]), device="cpu").encode(TEXTS)
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=name)
    query = "what moves token ids between processes?"
    for name in ("ce-deberta", "ce-electra"):
        status, _, body = task_stack.post_json("/rerank", {"model": name, "query": query,
                                                          "texts": TEXTS})
        assert status == 200, body
        cross = CrossEncoder(str(task_dirs[name]), device="cpu", max_length=TINY_MAX_TOKENS)
        want = cross.predict([(query, t) for t in TEXTS])
        np.testing.assert_allclose([r["score"] for r in sorted(body, key=lambda r: r["index"])],
                                   want, rtol=1e-5, atol=1e-5, err_msg=name)
    _, _, raw = task_stack.get("/admin/models", ADMIN)
    loaders = {m["name"]: {w["loader"] for w in m["workers"]}
               for m in json.loads(raw)["models"] if "workers" in m}
    assert loaders["mpnet"] == loaders["ce-electra"] == loaders["modernbert"] == \
        loaders["ce-deberta"] == loaders["qwen3"] == {"shmserve"}, loaders
    assert loaders["distil"] == {"transformers"}, loaders


def test_a_sentence_transformers_6_model_serves_its_own_pooling_and_limit(task_stack,
                                                                         task_dirs):
    """Saved by sentence-transformers 6 (`pooling_mode: cls`, max_seq_length in the
    tokenizer's config): served CLS-pooled at 16 tokens, as sentence-transformers encodes it;
    it was served mean-pooled at the model's position limit (an outside check)."""
    from sentence_transformers import SentenceTransformer

    texts = [*TEXTS, "word " * 40]  # past 16 tokens
    status, _, body = task_stack.post_json("/v1/embeddings", {"model": "st6-cls",
                                                              "input": texts})
    assert status == 200, body
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    reference = SentenceTransformer(str(task_dirs["st6-cls"]), device="cpu")
    np.testing.assert_allclose(got, reference.encode(texts), atol=2e-5)
    assert body["usage"]["prompt_tokens"] == int(
        reference.tokenize(texts)["attention_mask"].sum())
    _, _, raw = task_stack.get("/info")
    models = {m["name"]: m for m in json.loads(raw)["models"]}
    model = models["st6-cls"]
    assert (model["pooling"], model["max_input_tokens"]) == ("cls", 16), model
    # /info names each model's loader too (it was in /admin/models only: an outside check)
    assert (models["st6-cls"]["loader"], models["distil"]["loader"]) == (
        "shmserve", "transformers")


def test_pooling_modes_side_by_side_and_dense_projections_serve_sentence_transformers_vectors(
        task_stack, task_dirs):
    """Max and weighted-mean pooling side by side, then two Dense projections (64 -> 16 -> 8)
    and Normalize, as sentence-transformers saved them: served as it encodes, on the OpenAI and
    TEI routes; such a model was refused (max pooling, a Dense module)."""
    from sentence_transformers import SentenceTransformer

    texts = [*TEXTS, "word " * 40]
    want = SentenceTransformer(str(task_dirs["st6-dense"]), device="cpu").encode(texts)
    status, _, body = task_stack.post_json("/v1/embeddings", {"model": "st6-dense",
                                                              "input": texts})
    assert status == 200, body
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    assert got.shape == (len(texts), 8)
    np.testing.assert_allclose(got, want, atol=2e-5)
    status, _, body = task_stack.post_json("/embed", {"model": "st6-dense", "inputs": texts})
    assert status == 200, body
    np.testing.assert_allclose(np.array(body, dtype=np.float32), want, atol=2e-5)
    _, _, raw = task_stack.get("/info")
    model = {m["name"]: m for m in json.loads(raw)["models"]}["st6-dense"]
    assert (model["dim"], model["pooling"]) == (8, "max+weightedmean"), model
    assert [(d["in_features"], d["out_features"], d["activation"], d["bias"])
            for d in model["dense"]] == [(64, 16, "Tanh", True), (16, 8, "GELU", False)]
    # every token's row is the encoder's (32 wide), not the pooled vector's width
    status, _, body = task_stack.post_json("/embed_all", {"model": "st6-dense",
                                                          "inputs": texts[:2]})
    assert status == 200, body
    tokens = SentenceTransformer(str(task_dirs["st6-dense"]), device="cpu").encode(
        texts[:2], output_value="token_embeddings")
    for rows, want_rows in zip(body, tokens):
        np.testing.assert_allclose(np.array(rows, dtype=np.float32), want_rows.numpy(),
                                   atol=2e-5)


def test_a_static_embedding_model_serves_its_vectors(task_stack, task_dirs):
    """sentence-transformers' StaticEmbedding (model2vec's kind: no transformer, no special
    tokens): served as it encodes on the OpenAI and TEI routes, its tokens counted without
    specials; a text of whitespace, which has no tokens, is a 422 naming it."""
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(task_dirs["static"]), device="cpu")
    texts = [*TEXTS, "word " * 40]
    status, _, body = task_stack.post_json("/v1/embeddings", {"model": "static",
                                                              "input": texts})
    assert status == 200, body
    np.testing.assert_allclose(np.array([d["embedding"] for d in body["data"]], np.float32),
                               reference.encode(texts), atol=2e-5)
    assert body["usage"]["prompt_tokens"] == sum(
        len(reference[0].tokenizer.encode(t, add_special_tokens=False).ids) for t in texts)
    status, _, body = task_stack.post_json("/embed", {"model": "static", "inputs": ["a", " "]})
    assert status == 422 and "'inputs[1]' has no tokens for model 'static'" in str(body), body
    _, _, raw = task_stack.get("/info")
    model = {m["name"]: m for m in json.loads(raw)["models"]}["static"]
    assert (model["loader"], model["dim"], model["pooling"]) == ("shmserve", 32, "mean"), model


@pytest.mark.parametrize("name", ["ce-id", "ce-hot"])
def test_rerank_ranks_by_the_logit_on_every_route(task_stack, task_dirs, name):
    """An Identity cross-encoder scores its logit (never a logit of a logit); a sigmoid one past
    float32's saturation scores 1.0 everywhere but still ranks, and raw_scores gives the true
    logits, as sentence-transformers' CrossEncoder and TEI do."""
    import tritonclient.http as triton
    from sentence_transformers.cross_encoder import CrossEncoder
    from torch.nn import Identity

    query = "what moves token ids between processes?"
    pairs = [(query, d) for d in TEXTS]
    cross = CrossEncoder(str(task_dirs[name]), device="cpu", max_length=TINY_MAX_TOKENS)
    want, logits = cross.predict(pairs), cross.predict(pairs, activation_fn=Identity())
    best = np.argsort(-logits, kind="stable").tolist()
    assert len(set(logits.tolist())) == len(TEXTS)
    if name == "ce-hot":
        assert (want == 1.0).all() and best != list(range(len(TEXTS)))
    status, _, body = task_stack.post_json("/rerank", {"model": name, "query": query,
                                                  "texts": TEXTS})
    assert status == 200 and [r["index"] for r in body] == best, body
    np.testing.assert_allclose([r["score"] for r in body], want[best], rtol=1e-5, atol=1e-5)
    status, _, body = task_stack.post_json("/rerank", {"model": name, "query": query,
                                                  "texts": TEXTS, "raw_scores": True})
    assert status == 200 and [r["index"] for r in body] == best, body
    np.testing.assert_allclose([r["score"] for r in body], logits[best], rtol=1e-5, atol=1e-4)
    status, _, body = task_stack.post_json("/v1/rerank", {"model": name, "query": query,
                                                     "documents": TEXTS, "top_n": 3})
    assert status == 200 and [r["index"] for r in body["results"]] == best[:3], body
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], want[best[:3]],
                               rtol=1e-5, atol=1e-5)
    client = triton.InferenceServerClient(task_stack.url.removeprefix("http://"))
    question = triton.InferInput("query", [1], "BYTES")
    question.set_data_from_numpy(np.array([query.encode()], dtype=object))
    docs = triton.InferInput("text", [len(TEXTS)], "BYTES")
    docs.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object))
    result = client.infer(name, [question, docs])
    np.testing.assert_allclose(result.as_numpy("score"), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result.as_numpy("logit"), logits, rtol=1e-5, atol=1e-4)
    client.close()


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/embeddings", {"model": "clf", "input": "x"},
     "'clf' is a classification model; this route needs an embedding model"),
    ("/predict", {"model": "ce", "texts": ["x"]},
     "'ce' is a rerank model; /predict serves embedding and classification models"),
    ("/v1/rerank", {"model": "ce", "query": "", "documents": ["d"]}, "'query' must not be empty"),
    ("/v1/rerank", {"model": "ce", "documents": ["d"]}, "'query' is required"),
    ("/v1/rerank", {"model": "ce", "query": "q", "documents": [{"txt": "d"}]},
     "'documents[0]' must be a string or an object with a string 'text'"),
    ("/v1/rerank", {"model": "tiny", "query": "q", "documents": ["d"]},
     "needs a rerank model"),
    ("/v1/classify", {"model": "ab", "input": ["x"]}, "needs a classification model"),
    ("/v1/rerank", {"model": "ce", "query": "q", "documents": []}, "must not be empty"),
    ("/v1/rerank", {"model": "ce", "query": "q", "documents": "d"},
     "'documents' must be a list of strings or {\"text\"} objects"),
    ("/v1/rerank", {"model": "ce", "query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
    ("/v1/classify", {"model": "clf", "input": ["x"], "top_k": "2"}, "top_k"),
])
def test_a_route_refuses_a_model_of_another_task(task_stack, path, body, needle):
    status, _, answer = task_stack.post_json(path, body)
    want = 400 if path == "/v1/embeddings" else 422  # OpenAI's route answers as OpenAI does
    assert status == want and needle in answer["error"]["message"], answer


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


def inference_metrics(task_stack, model: str) -> dict:
    """shmserve_inference_requests_total of `model` by (variant, priority, status), and its
    latency histogram's counts by (variant, priority)."""
    out = {}
    _, _, raw = task_stack.get("/metrics")
    for family in text_string_to_metric_families(raw.decode()):
        for s in family.samples:
            if s.labels.get("model") != model:
                continue
            if s.name == "shmserve_inference_requests_total":
                out[s.labels["variant"], s.labels["priority"], s.labels["status"]] = s.value
            elif s.name == "shmserve_inference_request_duration_seconds_count":
                out[s.labels["variant"], s.labels["priority"]] = s.value
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
    after = inference_metrics(task_stack, "ab")
    grew = {key: after[key] - before.get(key, 0) for key in after
            if after[key] != before.get(key, 0)}
    counted = {key: n for key, n in grew.items() if len(key) == 3}
    assert sum(counted.values()) == 8 and {k[2] for k in counted} == {"200"}, grew
    assert {k[1] for k in counted} == {"1", "-1"} and {k[0] for k in counted} <= {"a", "b"}
    timed = {key: n for key, n in grew.items() if len(key) == 2}
    assert timed == {key[:2]: n for key, n in counted.items()}, grew


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
                     ({"weights": {"a": "1", "b": 2}}, "a: '1' is not a number from 0 to 1e+09"),
                     # Each finite, their sum not: it routed every request to one arm.
                     ({"weights": {"a": 1e308, "b": 1e308}}, "a: 1e+308 is not a number from 0 "
                      "to 1e+09")):
        status, _, raw = task_stack.request("PUT", "/admin/models/ab/split",
                                       json.dumps(bad).encode(), ADMIN)
        error = json.loads(raw)["error"]
        assert status == 422 and error["param"] == "weights", raw
        assert error["message"].endswith(why), raw
    status, _, raw = task_stack.request("POST", "/admin/models/ab/reload",
                                   json.dumps({"variant": "zz"}).encode(), ADMIN)
    assert status == 422 and "has no variant 'zz'; its variants are a, b" in raw.decode()
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
    assert models["ab"]["variants"] == [
        {"name": "a", "revision": "ab-r1", "weight": pytest.approx(1 - AB_WEIGHT_B)},
        {"name": "b", "revision": "ab-r2", "weight": pytest.approx(AB_WEIGHT_B)}]
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


def _as_dense(rows: list[list[dict]]) -> np.ndarray:
    out = np.zeros((len(rows), 30522), np.float32)
    for i, row in enumerate(rows):
        index = [v["index"] for v in row]
        assert index == sorted(set(index)), "indices in order, each once"
        assert all(v["value"] > 0 for v in row), "only non-zero values"
        out[i, index] = [v["value"] for v in row]
    return out


async def test_embed_sparse_gives_the_splade_vectors_of_the_masked_lm(task_stack, task_dirs):
    """TEI's /embed_sparse on a sparse model: per input its non-zero SPLADE values by
    vocabulary index, equal to transformers' masked LM through log(1 + relu), max over
    tokens; texts and token ids, JSON and msgpack, concurrent requests batched together;
    the sync and async clients; refusals name the route to use."""
    from shmserve.client import AsyncClient, Client

    texts = TEXTS + ["word " * 80]  # cut to the model's 64 tokens
    want = reference_splade(task_dirs["sp"], texts, TINY_MAX_TOKENS)
    status, headers, body = task_stack.post_json("/embed_sparse", {"inputs": texts,
                                                                   "model": "sp"})
    assert status == 200 and headers["X-Model-Revision"] == "sp-r1", body
    np.testing.assert_allclose(_as_dense(body), want, rtol=0, atol=1e-5)
    assert all(10 < len(row) < 3000 for row in body)
    # One string (and no model named: the first sparse model) is a list of one vector.
    status, _, body = task_stack.post_json("/embed_sparse", {"inputs": texts[1]})
    assert status == 200 and len(body) == 1, body
    np.testing.assert_allclose(_as_dense(body)[0], want[1], rtol=0, atol=1e-5)
    # Token ids as given, and msgpack both ways.
    ids = task_stack.post_json("/tokenize", {"inputs": texts[0], "model": "sp"})[2][0]
    status, _, raw = task_stack.request(
        "POST", "/embed_sparse", msgpack.packb({"inputs": [t["id"] for t in ids],
                                                "model": "sp"}),
        {"Content-Type": "application/msgpack", "Accept": "application/msgpack"})
    assert status == 200, raw
    np.testing.assert_allclose(_as_dense(msgpack.unpackb(raw))[0], want[0], rtol=0, atol=1e-5)
    # Concurrent requests, one text each: batched together, each its own vector back.
    async with aiohttp.ClientSession() as session:
        async def one(i):
            async with session.post(task_stack.url + "/embed_sparse",
                                    json={"inputs": texts[i % 5], "model": "sp"}) as resp:
                return i, resp.status, resp.headers["X-Batch-Size"], await resp.json()
        answers = await asyncio.gather(*(one(i) for i in range(20)))
    assert {status for _, status, _, _ in answers} == {200}
    assert max(int(size) for _, _, size, _ in answers) > 1  # they shared passes
    for i, _, _, got in answers:
        np.testing.assert_allclose(_as_dense(got)[0], want[i % 5], rtol=0, atol=1e-5)
    with Client(task_stack.url) as client:
        one_vector = client.embed_sparse(texts[2], model="sp")
        np.testing.assert_allclose(one_vector.dense(30522), want[2], rtol=0, atol=1e-5)
        assert one_vector.indices.dtype == np.int64 and one_vector.values.dtype == np.float32
    async with AsyncClient(task_stack.url, format="json") as client:
        vectors = await client.embed_sparse(texts[:2])
        np.testing.assert_allclose(np.stack([v.dense(30522) for v in vectors]), want[:2],
                                   rtol=0, atol=1e-5)
    # Refusals: a sparse model on the dense routes names /embed_sparse; a dense model here is
    # the wrong task; dimensions shorten dense vectors only.
    status, _, body = task_stack.post_json("/v1/embeddings", {"input": "x", "model": "sp"})
    assert status == 400 and "/embed_sparse" in body["error"]["message"], body
    status, _, body = task_stack.post_json("/embed", {"inputs": "x", "model": "sp"})
    assert status == 422 and body["error"]["code"] == "unsupported_task", body
    status, _, body = task_stack.post_json("/embed_sparse", {"inputs": "x", "model": "tiny"})
    assert status == 422 and body["error"]["code"] == "unsupported_task", body
    status, _, body = task_stack.post_json("/embed_sparse", {"inputs": "x", "dimensions": 8})
    assert status == 422 and body["error"]["param"] == "dimensions", body
    status, _, body = task_stack.post_json("/v2/models/sp/infer", {"inputs": [
        {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["x"]}]})
    assert status == 422 and "sparse" in body["error"], body
    status, _, body = task_stack.get("/v2/models/sp/ready")  # it said ready: 200
    assert status == 422 and "sparse" in json.loads(body)["error"], body
    # GET /info describes it as TEI does a SPLADE model.
    info = {m["name"]: m for m in json.loads(task_stack.get("/info")[2])["models"]}
    assert (info["sp"]["task"], info["sp"]["dim"], info["sp"]["pooling"],
            info["sp"]["normalize"]) == ("sparse", 30522, "splade", None)
