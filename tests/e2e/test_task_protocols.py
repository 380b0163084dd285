"""The scoring tasks through the clients and protocols users have (TEI's /predict and /rerank,
huggingface_hub, cohere, Triton's KServe tensors, shmserve.client), on the task stack of
tests/e2e/test_tasks.py, checked against the models run directly in transformers."""

import json

import numpy as np
import pytest

from tests.conftest import TINY_MAX_TOKENS
from tests.e2e.conftest import LABELS, QWEN3_INSTRUCTION
from tests.e2e.test_tasks import TEXTS
from tests.tinymodel import reference_scores, reference_yes_no_scores


def test_tei_predict_classifies_texts_and_pairs(task_stack, task_dirs):
    """TEI's /predict body on a classification model: one input (a text, or a pair of two
    strings) or a batch of [text] and [first, second] lists; every label, best first;
    raw_scores gives the logits."""
    pair = (TEXTS[0], TEXTS[2])
    items = [TEXTS[1], pair, TEXTS[3]]
    want = reference_scores(task_dirs["clf"], items, TINY_MAX_TOKENS)
    logits = reference_scores(task_dirs["clf"], items, TINY_MAX_TOKENS, raw=True)

    def ranked(row):
        order = np.argsort(-row, kind="stable")
        return [LABELS[i] for i in order], row[order]

    status, headers, body = task_stack.post_json("/predict", {
        "inputs": [[TEXTS[1]], list(pair), [TEXTS[3]]], "model": "clf"})
    assert status == 200 and headers["X-Model-Revision"] == "clf-r1", body
    assert len(body) == 3
    for got, row in zip(body, want):
        labels, scores = ranked(row)
        assert [p["label"] for p in got] == labels
        np.testing.assert_allclose([p["score"] for p in got], scores, atol=1e-5)
    # One pair, not a batch: one list back. raw_scores: the logits, best first.
    status, _, body = task_stack.post_json("/predict", {"inputs": list(pair), "raw_scores": True})
    assert status == 200, body
    labels, scores = ranked(logits[1])
    assert [p["label"] for p in body] == labels
    np.testing.assert_allclose([p["score"] for p in body], scores, atol=1e-5)
    status, _, body = task_stack.post_json("/predict", {"inputs": TEXTS[1]})  # one text
    assert status == 200 and [p["label"] for p in body] == ranked(want[0])[0], body
    # Too long without truncation: 413; TEI's shape on an embedding model: 422.
    status, _, body = task_stack.post_json("/predict", {"inputs": [TEXTS[0], "word " * 200],
                                                   "truncate": False})
    assert status == 413 and body["error"]["param"] == "inputs", body
    status, _, body = task_stack.post_json("/predict", {"inputs": "x", "model": "tiny"})
    assert status == 422 and body["error"]["code"] == "unsupported_task", body
    status, _, body = task_stack.post_json("/predict", {"inputs": "x", "texts": ["y"]})
    assert status == 422 and "not both" in body["error"]["message"], body
    # The native body still embeds.
    status, _, body = task_stack.post_json("/predict", {"texts": ["x"], "model": "tiny"})
    assert status == 200 and len(body["results"][0]) == 32
    # A reranker, as TEI's /predict serves one: its one logit through a sigmoid (raw_scores:
    # the logit), labelled as /info names it (refused 422 before: an outside check)
    query = "what moves token ids between processes?"
    items = [(query, TEXTS[0]), (query, TEXTS[1]), TEXTS[2]]
    ce_logits = reference_scores(task_dirs["ce"], items, TINY_MAX_TOKENS, raw=True).ravel()
    status, _, body = task_stack.post_json("/predict", {
        "inputs": [list(items[0]), list(items[1]), [items[2]]], "model": "ce"})
    assert status == 200 and len(body) == 3, body
    assert all([p["label"] for p in got] == ["LABEL_0"] for got in body), body
    np.testing.assert_allclose([got[0]["score"] for got in body],
                               1 / (1 + np.exp(-ce_logits)), atol=1e-5)
    status, _, body = task_stack.post_json("/predict", {"inputs": list(items[0]), "model": "ce",
                                                        "raw_scores": True})
    assert status == 200, body
    np.testing.assert_allclose([body[0]["score"]], ce_logits[:1], atol=1e-5)
    # Token embeddings are an embedding model's.
    for name in ("clf", "ce"):
        status, _, body = task_stack.post_json("/embed_all", {"inputs": "x", "model": name})
        assert status == 422 and body["error"]["code"] == "unsupported_task", body


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_the_native_client_classifies_and_reranks(task_stack, task_dirs, fmt):
    from shmserve.client import AsyncClient, Client

    probs = reference_scores(task_dirs["clf"], TEXTS, TINY_MAX_TOKENS)
    query = "what moves token ids between processes?"
    scores = reference_scores(task_dirs["ce"], [(query, d) for d in TEXTS], TINY_MAX_TOKENS)
    with Client(task_stack.url, format=fmt) as client:
        got, labels = client.classify(TEXTS, model="clf")
        assert labels == LABELS and got.dtype == np.float32 and got.shape == (4, 3)
        np.testing.assert_allclose(got, probs, atol=1e-5)
        got = client.rerank(query, TEXTS, model="ce")
        assert got.dtype == np.float32 and got.shape == (4,)
        np.testing.assert_allclose(got, scores, atol=1e-5)  # input order, not ranked
    async with AsyncClient(task_stack.url, format=fmt) as client:
        got, labels = await client.classify(TEXTS[0])  # the first classification model
        assert labels == LABELS and got.shape == (3,)  # one string: one row, as embed's
        np.testing.assert_allclose(got, probs[0], atol=1e-5)
        np.testing.assert_allclose(await client.rerank(query, TEXTS, model="ce"), scores,
                                   atol=1e-5)


def test_a_multi_label_classifier_scores_each_label_by_its_sigmoid(task_stack, task_dirs):
    """config.json problem_type multi_label_classification (toxicity's kind: labels that hold
    together): each label's sigmoid, as transformers' pipeline gives it, where a softmax made
    them sum to 1 (an outside check); the softmax still when asked for by name."""
    want = reference_scores(task_dirs["clf-multi"], TEXTS, TINY_MAX_TOKENS)
    logits = reference_scores(task_dirs["clf-multi"], TEXTS, TINY_MAX_TOKENS, raw=True)
    np.testing.assert_allclose(want, 1 / (1 + np.exp(-logits)), rtol=1e-6)  # not a softmax
    status, _, body = task_stack.post_json("/v1/classify", {"model": "clf-multi",
                                                            "input": TEXTS})
    assert status == 200, body
    np.testing.assert_allclose([d["probs"] for d in body["data"]], want, atol=1e-5)
    # TEI's /predict: the model's scores
    status, _, body = task_stack.post_json("/predict", {"inputs": [[TEXTS[0]]],
                                                        "model": "clf-multi"})
    assert status == 200, body
    order = np.argsort(-want[0], kind="stable")
    np.testing.assert_allclose([p["score"] for p in body[0]], want[0][order], atol=1e-5)
    # huggingface_hub's body at /: the model's by default, a softmax when asked for
    softmax = np.exp(logits[0]) / np.exp(logits[0]).sum()
    for parameters, scores in (({}, want[0]), ({"function_to_apply": "softmax"}, softmax)):
        status, _, body = task_stack.post_json("/", {"inputs": TEXTS[0], "model": "clf-multi",
                                                     "parameters": parameters})
        assert status == 200, body
        order = np.argsort(-scores, kind="stable")
        assert [p["label"] for p in body[0]] == [LABELS[i] for i in order]
        np.testing.assert_allclose([p["score"] for p in body[0]], scores[order], atol=1e-5)


def test_huggingface_hubs_text_classification_at_the_servers_url(task_stack, task_dirs,
                                                                 monkeypatch):
    """InferenceClient(model=URL).text_classification posts {"inputs", "parameters"} to /."""
    import huggingface_hub.constants
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import HfHubHTTPError

    # conftest sets HF_HUB_OFFLINE, which makes the client refuse even 127.0.0.1.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    want = reference_scores(task_dirs["clf"], TEXTS[:1], TINY_MAX_TOKENS)[0]
    best = np.argsort(-want, kind="stable")
    with InferenceClient(model=task_stack.url) as hub:
        got = hub.text_classification(TEXTS[0])
        assert [x.label for x in got] == [LABELS[i] for i in best]
        np.testing.assert_allclose([x.score for x in got], want[best], atol=1e-5)
        assert [x.label for x in hub.text_classification(TEXTS[0], top_k=1)] == \
            [LABELS[best[0]]]
        # The other scorings, from the logits: sigmoid per label, or the logits themselves.
        logits = reference_scores(task_dirs["clf"], TEXTS[:1], TINY_MAX_TOKENS, raw=True)[0]
        for applied, scores in (("sigmoid", 1 / (1 + np.exp(-logits))), ("none", logits)):
            got = hub.text_classification(TEXTS[0], function_to_apply=applied)
            order = np.argsort(-scores, kind="stable")
            assert [x.label for x in got] == [LABELS[i] for i in order]
            np.testing.assert_allclose([x.score for x in got], scores[order], atol=1e-5)
        with pytest.raises(HfHubHTTPError) as info:  # the client sends what it is given
            hub.text_classification(TEXTS[0], function_to_apply="tanh")
        assert info.value.response.status_code == 422
        # The same client's feature_extraction still embeds (no `parameters` in its body).
        assert hub.feature_extraction("x").shape[-1] == 32
        # zero-shot posts its labels to / too: refused, not answered with the model's labels
        with pytest.raises(HfHubHTTPError) as info:
            hub.zero_shot_classification(TEXTS[0], ["pos", "neg"])
        assert info.value.response.status_code == 422
        assert "'parameters.candidate_labels' is not a text-classification parameter" in \
            info.value.response.text, info.value.response.text
    status, _, body = task_stack.post_json("/", {"inputs": "x", "parameters": {"top_k": 0}})
    assert status == 422 and body["error"]["param"] == "parameters", body
    assert body["error"]["message"].startswith("'parameters.top_k' must be"), body


def test_coheres_clients_rerank_on_v1_and_v2(task_stack, task_dirs):
    """cohere's own Python client, v1 (`Client`: /v1/rerank) and v2 (`ClientV2`: /v2/rerank,
    which is not KServe's), pointed at the server's URL."""
    import cohere

    query = "what moves token ids between processes?"
    want = reference_scores(task_dirs["ce"], [(query, d) for d in TEXTS], TINY_MAX_TOKENS)
    best = np.argsort(-want, kind="stable")[:3].tolist()
    with cohere.Client(api_key="unused", base_url=task_stack.url) as v1:
        got = v1.rerank(model="ce", query=query, documents=TEXTS, top_n=3,
                        return_documents=True)
    assert [r.index for r in got.results] == best
    np.testing.assert_allclose([r.relevance_score for r in got.results], want[best], atol=1e-5)
    assert [r.document.text for r in got.results] == [TEXTS[i] for i in best]
    with cohere.Client(api_key="unused", base_url=task_stack.url) as v1:
        # v1's options this server does not do are refused, not ignored; ["text"] is what it
        # does anyway.
        got = v1.rerank(model="ce", query=query, documents=[{"text": t} for t in TEXTS],
                        rank_fields=["text"])
        assert sorted(r.index for r in got.results) == [0, 1, 2, 3]
        for option in ({"rank_fields": ["title"]}, {"max_chunks_per_doc": 3}):
            with pytest.raises(cohere.UnprocessableEntityError) as info:
                v1.rerank(model="ce", query=query, documents=TEXTS, **option)
            assert info.value.body["error"]["param"] == next(iter(option))
    with cohere.ClientV2(api_key="unused", base_url=task_stack.url) as v2:
        got = v2.rerank(model="ce", query=query, documents=TEXTS, top_n=3)
        assert [r.index for r in got.results] == best
        np.testing.assert_allclose([r.relevance_score for r in got.results], want[best],
                                   atol=1e-5)
        assert got.id and got.meta.billed_units.search_units == 1
        with pytest.raises(cohere.NotFoundError) as info:
            v2.rerank(model="nope", query=query, documents=TEXTS)
        assert info.value.body["error"]["param"] == "model"  # our error shape, not KServe's
        # max_tokens_per_doc: each document cut to its first 3 tokens (of the model's
        # tokenizer), then paired (it was refused: cohere-haystack's CohereRanker always sends
        # it, an outside check); 4096, its default there, changes nothing here
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(task_dirs["ce"] / "tokenizer.json"))
        tok.no_padding()  # (the saved tokenizer pads)
        spans = [tok.encode(d, add_special_tokens=False).offsets for d in TEXTS]
        cut = [d[:o[2][1]] if len(o) > 3 else d for d, o in zip(TEXTS, spans)]
        short = reference_scores(task_dirs["ce"], [(query, d) for d in cut], TINY_MAX_TOKENS)
        got = v2.rerank(model="ce", query=query, documents=TEXTS, max_tokens_per_doc=3)
        np.testing.assert_allclose([r.relevance_score for r in got.results],
                                   short[[r.index for r in got.results]], atol=1e-5)
        assert not np.allclose(short, want, atol=1e-3)  # the cut made a difference
        got = v2.rerank(model="ce", query=query, documents=TEXTS, max_tokens_per_doc=4096)
        assert [r.index for r in got.results][:3] == best
        with pytest.raises(cohere.BadRequestError) as info:  # as Cohere answers a bad body
            v2.rerank(model="ce", query=query, documents=TEXTS, max_tokens_per_doc=0)
        assert info.value.body["error"]["param"] == "max_tokens_per_doc"


def test_tei_rerank_on_the_cross_encoder(task_stack, task_dirs):
    query = "what moves token ids between processes?"
    want = reference_scores(task_dirs["ce"], [(query, d) for d in TEXTS], TINY_MAX_TOKENS)
    status, headers, body = task_stack.post_json("/rerank", {"model": "ce", "query": query,
                                                        "texts": TEXTS, "return_text": True})
    assert status == 200, body
    assert [r["index"] for r in body] == np.argsort(-want, kind="stable").tolist()
    np.testing.assert_allclose([r["score"] for r in body], want[[r["index"] for r in body]],
                               atol=1e-5)
    assert all(r["text"] == TEXTS[r["index"]] for r in body)
    assert headers["X-Model-Revision"] == "ce-r1"
    # TEI's / takes the same body for a reranker.
    assert task_stack.post_json("/", {"model": "ce", "query": query, "texts": TEXTS,
                                 "return_text": True})[2] == body
    status, _, raw = task_stack.post_json("/rerank", {"model": "ce", "query": query, "texts": TEXTS,
                                                 "raw_scores": True})
    # TEI's raw_scores: the logit before the sigmoid.
    logits = reference_scores(task_dirs["ce"], [(query, d) for d in TEXTS], TINY_MAX_TOKENS,
                              raw=True)
    np.testing.assert_allclose([r["score"] for r in raw], logits[[r["index"] for r in raw]],
                               atol=1e-4)
    assert "text" not in raw[0]
    # TEI's truncate is honoured per request (the stack cuts over-long pairs by default).
    long = "word " * 200
    status, _, err = task_stack.post_json("/rerank", {"model": "ce", "query": long, "texts": ["d"],
                                                 "truncate": False})
    assert status == 413 and "the query with 'texts[0]'" in err["error"]["message"]
    assert task_stack.post_json("/rerank", {"model": "ce", "query": long, "texts": ["d"]})[0] == 200
    status, _, err = task_stack.post_json("/rerank", {"model": "ce", "query": "q", "texts": ["d"],
                                                 "priority": "urgent"})
    assert status == 422 and err["error"]["param"] == "priority"


def test_a_reranker_answering_yes_or_no_ranks_as_its_model_card_scores(task_stack, task_dirs):
    """A Qwen3-Reranker-like causal LM (shmserve.yes_no) through nginx: TEI's /rerank and
    cohere's client score each pair as the model card's code does (its prompt with the
    configured instruction, P(yes) over "yes" and "no"); raw_scores give yes - no; a text
    alone is refused; /info names the prompt's instruction."""
    import cohere

    query = "what moves token ids between processes?"
    want = reference_yes_no_scores(task_dirs["qwen3-ce"], query, TEXTS, 512, QWEN3_INSTRUCTION)
    status, _, body = task_stack.post_json("/rerank", {"model": "qwen3-ce", "query": query,
                                                       "texts": TEXTS})
    assert status == 200, body
    assert [r["index"] for r in body] == np.argsort(-want, kind="stable").tolist()
    np.testing.assert_allclose([r["score"] for r in body], want[[r["index"] for r in body]],
                               atol=1e-5)
    _, _, raw = task_stack.post_json("/rerank", {"model": "qwen3-ce", "query": query,
                                                 "texts": TEXTS, "raw_scores": True})
    np.testing.assert_allclose([r["score"] for r in raw],
                               np.log(want / (1 - want))[[r["index"] for r in raw]], atol=1e-4)
    with cohere.ClientV2(api_key="unused", base_url=task_stack.url) as v2:
        got = v2.rerank(model="qwen3-ce", query=query, documents=TEXTS, top_n=2)
    np.testing.assert_allclose([r.relevance_score for r in got.results],
                               np.sort(want)[::-1][:2], atol=1e-5)
    status, _, err = task_stack.post_json("/predict", {"model": "qwen3-ce",
                                                       "inputs": [[query, TEXTS[0]], ["alone"]]})
    assert status == 422 and "is a text alone" in err["error"]["message"], err
    _, _, info = task_stack.get("/info")
    (model,) = [m for m in json.loads(info)["models"] if m["name"] == "qwen3-ce"]
    assert model["instruction"] == QWEN3_INSTRUCTION, model


def test_kserve_classification_and_rerank_tensors(task_stack, task_dirs):
    import tritonclient.http as triton

    client = triton.InferenceServerClient(task_stack.url.removeprefix("http://"))
    config = client.get_model_config("clf")
    assert (config["max_batch_size"], config["output"]) == (64, [
        {"name": "probabilities", "data_type": "TYPE_FP32", "dims": [3]}])
    assert json.loads(config["parameters"]["labels"]["string_value"]) == LABELS
    config = client.get_model_config("ce")  # one query for all texts: not batched
    assert config["max_batch_size"] == 0 and [(t["name"], t["dims"]) for t in config["input"]] \
        == [("query", [1]), ("text", [-1])] and config["output"][0]["dims"] == [-1]
    meta = client.get_model_metadata("clf")
    assert meta["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 3]}]
    # a JSON string: the protocol's parameter values are strings, numbers or booleans (a
    # list was there: an outside check against KServe's spec)
    assert json.loads(meta["parameters"]["labels"]) == LABELS
    for binary in (True, False):
        text = triton.InferInput("text", [len(TEXTS)], "BYTES")
        text.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object),
                                 binary_data=binary)
        out = triton.InferRequestedOutput("probabilities", binary_data=binary)
        got = client.infer("clf", [text], outputs=[out]).as_numpy("probabilities")
        np.testing.assert_allclose(got, reference_scores(task_dirs["clf"], TEXTS, TINY_MAX_TOKENS),
                                   atol=1e-5)
    query = triton.InferInput("query", [1], "BYTES")
    query.set_data_from_numpy(np.array([b"what moves token ids?"], dtype=object))
    docs = triton.InferInput("text", [len(TEXTS)], "BYTES")
    docs.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object))
    scores = client.infer("ce", [query, docs]).as_numpy("score")
    want = reference_scores(task_dirs["ce"], [("what moves token ids?", d) for d in TEXTS],
                            TINY_MAX_TOKENS)
    np.testing.assert_allclose(scores, want, atol=1e-5)
    client.close()
