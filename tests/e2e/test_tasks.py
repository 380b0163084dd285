"""Every task and model format through nginx, on one stack of tiny models built here and checked
against the same models run directly in transformers (A/B splits and pinning on the same stack:
test_task_variants.py)."""

import asyncio
import json

import aiohttp
import msgpack
import numpy as np
import pytest

from tests.conftest import TINY_MAX_TOKENS
from tests.e2e.conftest import LABELS, TOKEN
from tests.tinymodel import reference_scores, reference_splade

ADMIN = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello",
         "Shared memory moves token ids between processes without copies.",
         "An embedding is a vector that represents a piece of text."]


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
        # up to three bursts: one whose requests the worker took one by one, as they came
        # (a loaded CI run: every pass of 1), shows nothing of the batching
        for _ in range(3):
            answers = await asyncio.gather(*(one(i) for i in range(20)))
            assert {status for _, status, _, _ in answers} == {200}
            if max(int(size) for _, _, size, _ in answers) > 1:  # they shared passes
                break
        else:
            raise AssertionError("three bursts of 20 requests, every pass of 1 text")
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


def test_infinitys_routes_answer_as_infinity_does(task_stack, task_dirs):
    """infinity's /embeddings, /rerank (a body with `documents`) and /classify at its paths, in
    its answers' shapes: its clients, and an OpenAI client whose base URL is the server's root
    (as infinity's docs write it), work unchanged."""
    import openai

    client = openai.OpenAI(base_url=task_stack.url, api_key="unused", max_retries=0)
    got = client.embeddings.create(model="tiny", input=TEXTS[:2])
    _, _, direct = task_stack.post_json("/v1/embeddings", {"model": "tiny", "input": TEXTS[:2]})
    np.testing.assert_array_equal(  # (the client asks for base64: float32 both ways)
        np.array([d.embedding for d in got.data], dtype=np.float32),
        np.array([d["embedding"] for d in direct["data"]], dtype=np.float32))
    with pytest.raises(openai.BadRequestError):  # OpenAI's status, as on /v1/embeddings
        client.embeddings.create(model="tiny", input=[])
    # infinity_client's body: dimensions 0 (the model's width) and a modality (0.0.78, checked
    # by hand: its pins, httpx < 0.28, keep it out of the test extra)
    status, _, body = task_stack.post_json("/embeddings", {
        "model": "tiny", "input": TEXTS[:2], "dimensions": 0, "modality": "text"})
    assert status == 200 and body["data"][0]["embedding"] == direct["data"][0]["embedding"]
    status, _, body = task_stack.post_json("/embeddings", {
        "model": "tiny", "input": TEXTS[:2], "modality": "image"})
    assert status == 400 and body["error"]["param"] == "modality", body
    status, _, body = task_stack.post_json("/v1/embeddings", {
        "model": "tiny", "input": TEXTS[:2], "dimensions": 0})  # OpenAI's own: refused
    assert status == 400 and body["error"]["param"] == "dimensions", body

    query = "what moves token ids between processes?"
    want = reference_scores(task_dirs["ce"], [(query, d) for d in TEXTS], TINY_MAX_TOKENS)
    raw = reference_scores(task_dirs["ce"], [(query, d) for d in TEXTS], TINY_MAX_TOKENS,
                           raw=True)
    best = np.argsort(-want, kind="stable").tolist()
    status, headers, body = task_stack.post_json("/rerank", {
        "model": "ce", "query": query, "documents": TEXTS, "return_documents": True,
        "top_n": 3})
    assert status == 200, body
    assert (body["object"], body["model"], body["id"]) == ("rerank", "ce",
                                                           headers["X-Request-ID"])
    assert isinstance(body["created"], int) and body["usage"]["total_tokens"] > 0
    assert [r["index"] for r in body["results"]] == best[:3]
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]],
                               want[best[:3]], atol=1e-5)
    assert [r["document"] for r in body["results"]] == [TEXTS[i] for i in best[:3]]
    status, _, body = task_stack.post_json("/rerank", {
        "model": "ce", "query": query, "documents": TEXTS, "raw_scores": True})
    assert status == 200 and [r["document"] for r in body["results"]] == [None] * len(TEXTS)
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], raw[best],
                               atol=1e-4)
    # a body with texts is TEI's, as before
    status, _, body = task_stack.post_json("/rerank", {"model": "ce", "query": query,
                                                       "texts": TEXTS})
    assert status == 200 and [r["index"] for r in body] == best

    want = reference_scores(task_dirs["clf"], TEXTS, TINY_MAX_TOKENS)
    logits = reference_scores(task_dirs["clf"], TEXTS, TINY_MAX_TOKENS, raw=True)
    for flag, expected in ((False, want), (True, logits)):
        status, _, body = task_stack.post_json("/classify", {"model": "clf", "input": TEXTS,
                                                             "raw_scores": flag})
        assert status == 200 and body["object"] == "classify" and body["model"] == "clf", body
        for row, ranked in zip(expected, body["data"]):
            order = np.argsort(-row, kind="stable")
            assert [x["label"] for x in ranked] == [LABELS[i] for i in order]
            np.testing.assert_allclose([x["score"] for x in ranked], row[order], atol=1e-4)
    status, _, body = task_stack.post_json("/classify", {"model": "clf"})
    assert status == 422 and "'input' is required" in body["error"]["message"], body

    status, _, raw = task_stack.get("/models")
    models = {m["id"]: m for m in json.loads(raw)["data"]}
    assert status == 200 and "owned_by" not in models["tiny"]  # infinity_client's enum
    assert [models[name]["capabilities"] for name in ("tiny", "ce", "clf")] == [
        ["embed"], ["rerank"], ["classify"]]
    assert models["clf"]["stats"]["ready_workers"] == 1  # clf: on worker 1 alone
    assert models["tiny"]["stats"]["ready_workers"] == 2


def test_a_rerank_is_never_bulk_and_a_large_classification_is(task_stack):
    """frontends.bulk_texts (16): a request of that many inputs or more that names no priority
    runs a step below the default, but a rerank's documents are one query's candidates (a
    RAG query reranks 20-100 of them): it keeps the default."""
    sent = {"rerank-20": ("/v1/rerank", {"model": "ce", "query": "q",
                                         "documents": [f"doc {i}" for i in range(20)]}),
            "classify-16": ("/v1/classify", {"model": "clf", "input": ["x"] * 16}),
            "classify-15": ("/v1/classify", {"model": "clf", "input": ["x"] * 15})}
    for rid, (path, body) in sent.items():
        status, _, answer = task_stack.post_json(path, body, {"X-Request-ID": rid})
        assert status == 200, answer

    def lines():
        return {line["request_id"]: line for i in range(2)
                for line in task_stack.log_lines(f"frontend-{i}")
                if line.get("request_id") in sent and line.get("message") == "request"}
    task_stack.wait_until(lambda: len(lines()) == 3, 10, "the access lines")
    assert {rid: line.get("priority") for rid, line in lines().items()} == {
        "rerank-20": None, "classify-16": -1, "classify-15": None}
