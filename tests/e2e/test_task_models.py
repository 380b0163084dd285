"""Which model formats serve, through nginx on the task stack (tests/e2e/conftest.py):
architectures other than BERT's, sentence-transformers 6's files, pooling modes side by side
with Dense projections, and static embedding models, each against sentence-transformers."""

import json

import numpy as np

from tests.conftest import TINY_MAX_TOKENS
from tests.e2e.test_tasks import ADMIN, TEXTS


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
