"""TEI's routes through nginx: huggingface_hub's InferenceClient (the client TEI users have),
and TEI's request and response shapes by hand where that client has no method."""

import json

import huggingface_hub
import msgpack
import numpy as np
import pytest
import torch
from huggingface_hub import InferenceClient
from huggingface_hub.errors import HfHubHTTPError

from tests.conftest import TINY_MAX_TOKENS
from tests.e2e.test_api import TEXTS
from tests.tinymodel import reference_embeddings


@pytest.fixture(autouse=True)
def hub_online(monkeypatch):
    # conftest sets HF_HUB_OFFLINE, and the hub's client then refuses every request, even to a
    # local server. This module's clients only ever talk to the stack on 127.0.0.1.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


@pytest.fixture(scope="module")
def hub(tiny_stack):
    with InferenceClient(model=tiny_stack.url + "/embed") as client:
        yield client


def test_feature_extraction_equals_the_native_api(hub, native):
    got = hub.feature_extraction(TEXTS)
    assert got.dtype == np.float32 and got.shape == (4, 32)
    np.testing.assert_allclose(got, native, rtol=0, atol=1e-6)
    one = hub.feature_extraction(TEXTS[0], normalize=True, truncate=False)
    np.testing.assert_allclose(one, native[:1], rtol=0, atol=1e-6)


def test_normalize_false_gives_the_pooled_vectors_as_they_are(hub, tiny_stack, tiny_model,
                                                              native):
    """The tiny model normalises its vectors itself (a Normalize module, as the default model
    has): TEI's normalize=false gives them as pooled, through huggingface_hub's client, with
    `dimensions`, and beside normalised requests sent at once (a pass never mixes the two)."""
    from concurrent.futures import ThreadPoolExecutor

    want = reference_embeddings(tiny_model, TEXTS, TINY_MAX_TOKENS, normalize=False)
    got = hub.feature_extraction(TEXTS, normalize=False)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert np.abs(np.linalg.norm(got, axis=1) - 1).min() > 0.1  # not unit vectors
    got = hub.feature_extraction(TEXTS, normalize=False, dimensions=8)
    np.testing.assert_allclose(got, want[:, :8], rtol=0, atol=1e-5)

    def one(i):
        status, _, body = tiny_stack.post_json("/embed", {"inputs": TEXTS,
                                                          "normalize": bool(i % 2)})
        return status, np.array(body, np.float32)

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(64)))
    for i, (status, got) in enumerate(answers):
        assert status == 200
        np.testing.assert_allclose(got, native if i % 2 else want, rtol=0, atol=1e-5)


def test_feature_extraction_truncates_when_asked(hub, tiny_stack):
    long = "word " * 200  # over the tiny model's 64 tokens; the stack does not truncate itself
    with pytest.raises(HfHubHTTPError) as info:
        hub.feature_extraction(long)
    assert info.value.response.status_code == 413
    right = hub.feature_extraction(long + "tail", truncate=True)
    left = hub.feature_extraction(long + "tail", truncate=True, truncation_direction="left")
    assert right.shape == left.shape == (1, 32) and not np.allclose(right, left)


def test_feature_extraction_dimensions(hub, native):
    got = hub.feature_extraction(TEXTS, dimensions=8)
    want = native[:, :8] / np.linalg.norm(native[:, :8], axis=1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


async def test_async_client(tiny_stack, native):
    from huggingface_hub import AsyncInferenceClient

    async with AsyncInferenceClient(model=tiny_stack.url + "/embed") as client:
        got = await client.feature_extraction(TEXTS[:2])
    np.testing.assert_allclose(got, native[:2], rtol=0, atol=1e-6)


def test_embed_shapes_by_hand(tiny_stack, native, tiny_model):
    status, _, body = tiny_stack.post_json("/embed", {"inputs": TEXTS[1]})
    assert status == 200 and np.array(body).shape == (1, 32)  # always a list of vectors
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    tok.no_padding()
    ids = [tok.encode(t).ids for t in TEXTS]
    status, _, body = tiny_stack.post_json("/embed", {"inputs": ids, "model": "tiny-alias"})
    assert status == 200
    np.testing.assert_allclose(np.array(body, np.float32), native, rtol=0, atol=1e-6)


def test_embed_msgpack_vectors_are_raw_float32(tiny_stack, native):
    status, headers, raw = tiny_stack.request(
        "POST", "/embed", msgpack.packb({"inputs": TEXTS}),
        {"Content-Type": "application/msgpack", "Accept": "application/msgpack"})
    assert status == 200 and headers["Content-Type"].startswith("application/msgpack")
    got = np.stack([np.frombuffer(v, "<f4") for v in msgpack.unpackb(raw)])
    np.testing.assert_allclose(got, native, rtol=0, atol=1e-6)


def test_embed_all_is_every_tokens_last_hidden_state(tiny_stack, tiny_model):
    """TEI's /embed_all: one list of rows per input, a row per token (special tokens
    included), the network's last hidden state as transformers computes it; JSON, token ids,
    msgpack (raw float32 rows) and a named prompt."""
    from tokenizers import Tokenizer
    from transformers import AutoModel

    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    tok.no_padding()
    net = AutoModel.from_pretrained(tiny_model).eval()

    def hidden(text):
        ids = torch.tensor([tok.encode(text).ids])
        with torch.inference_mode():
            return net(input_ids=ids).last_hidden_state[0].numpy()

    status, headers, body = tiny_stack.post_json("/embed_all", {"inputs": TEXTS})
    assert status == 200 and len(body) == len(TEXTS) and "X-Inference-Time" in headers
    for text, rows in zip(TEXTS, body):
        np.testing.assert_allclose(np.array(rows, np.float32), hidden(text), rtol=0, atol=1e-5)
    status, _, body = tiny_stack.post_json("/embed_all", {"inputs": TEXTS[2]})
    assert status == 200 and len(body) == 1
    np.testing.assert_allclose(np.array(body[0], np.float32), hidden(TEXTS[2]), atol=1e-5)
    ids = [tok.encode(t).ids for t in TEXTS[:2]]
    status, _, body = tiny_stack.post_json("/embed_all", {"inputs": ids})
    assert status == 200 and [len(rows) for rows in body] == [len(i) for i in ids]
    status, headers, raw = tiny_stack.request(
        "POST", "/embed_all", msgpack.packb({"inputs": TEXTS, "prompt_name": "query"}),
        {"Content-Type": "application/msgpack", "Accept": "application/msgpack"})
    assert status == 200 and headers["Content-Type"].startswith("application/msgpack")
    for text, rows in zip(TEXTS, msgpack.unpackb(raw)):
        got = np.stack([np.frombuffer(r, "<f4") for r in rows])
        np.testing.assert_allclose(got, hidden("query: " + text), rtol=0, atol=1e-5)


def test_embed_all_and_pooled_requests_at_once_each_get_their_own_shape(tiny_stack, native):
    """Per-token and pooled requests for one model queue on the same workers; a pass never
    mixes them (a per-token pass writes a row a token)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i):
        if i % 2:
            status, _, body = tiny_stack.post_json("/embed", {"inputs": TEXTS})
            return status, np.array(body, np.float32)
        status, _, body = tiny_stack.post_json("/embed_all", {"inputs": TEXTS})
        return status, [np.array(rows, np.float32) for rows in body]

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(64)))
    first = answers[0][1]
    for i, (status, got) in enumerate(answers):
        assert status == 200
        if i % 2:
            np.testing.assert_allclose(got, native, rtol=0, atol=1e-6)
        else:
            for rows, want in zip(got, first):
                np.testing.assert_allclose(rows, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("body,status,param", [
    ({"inputs": []}, 422, "inputs"),
    ({}, 422, "inputs"),
    ({"inputs": TEXTS, "truncation_direction": "up"}, 422, "truncation_direction"),
    ({"inputs": TEXTS, "prompt_name": "passage"}, 422, "prompt_name"),
    ({"inputs": "word " * 200}, 413, "inputs"),  # over 64 tokens; truncate not asked
    ({"inputs": TEXTS, "dimensions": 8}, 422, "dimensions"),  # pooled vectors only
])
def test_embed_all_refusals(tiny_stack, body, status, param):
    got, _, err = tiny_stack.post_json("/embed_all", body)
    assert got == status and err["error"]["param"] == param, err


@pytest.mark.parametrize("body,param", [
    ({"inputs": TEXTS, "normalize": "no"}, "normalize"),
    ({"inputs": TEXTS, "prompt_name": "passage"}, "prompt_name"),  # tiny has only "query"
    ({"inputs": TEXTS, "prompt_name": 3}, "prompt_name"),
    ({"inputs": [[101, 2088, 102]], "prompt_name": "query"}, "prompt_name"),  # ids as given
    ({"inputs": TEXTS, "truncation_direction": "up"}, "truncation_direction"),
    ({"inputs": TEXTS, "dimensions": 64}, "dimensions"),
    ({"inputs": []}, "inputs"),
    ({}, "inputs"),
    ({"inputs": "x", "priority": "urgent"}, "priority"),  # read, as on every embedding route
    ({"inputs": "x", "user": 7}, "user"),
])
def test_embed_refusals(tiny_stack, body, param):
    status, _, err = tiny_stack.post_json("/embed", body)
    assert status == 422 and err["error"]["param"] == param


def test_a_named_prompt_goes_before_each_text_on_every_embedding_route(tiny_stack, hub):
    """tiny's configured prompts: {"query": "query: "}, no default (tests/conftest.py)."""
    prompted = ["query: " + t for t in TEXTS]
    _, _, want = tiny_stack.post_json("/embed", {"inputs": prompted})
    want = np.array(want, np.float32)
    _, _, plain = tiny_stack.post_json("/embed", {"inputs": TEXTS})
    assert np.abs(want - np.array(plain, np.float32)).max() > 1e-3  # the prompt matters
    got = hub.feature_extraction(TEXTS, prompt_name="query")
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    status, _, body = tiny_stack.post_json("/predict", {"texts": TEXTS, "prompt_name": "query"})
    assert status == 200
    np.testing.assert_allclose(body["results"], want, rtol=0, atol=1e-6)
    status, _, body = tiny_stack.post_json("/v1/embeddings", {"input": TEXTS,
                                                              "prompt_name": "query"})
    assert status == 200 and body["usage"]["prompt_tokens"] > 3 * len(TEXTS)
    np.testing.assert_allclose([d["embedding"] for d in body["data"]], want, rtol=0, atol=1e-6)
    status, _, body = tiny_stack.post_json("/similarity", {
        "inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}, "prompt_name": "query"})
    assert status == 200
    np.testing.assert_allclose(body, want[1:] @ want[0], rtol=0, atol=1e-5)
    # TEI's own form: the options in "parameters" (they were dropped without a word), on
    # /similarity and on / alike
    for route in ("/similarity", "/"):
        status, _, body = tiny_stack.post_json(route, {
            "inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]},
            "parameters": {"prompt_name": "query"}})
        assert status == 200, body
        np.testing.assert_allclose(body, want[1:] @ want[0], rtol=0, atol=1e-5)
    status, _, err = tiny_stack.post_json("/similarity", {
        "inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]},
        "parameters": {"prompt_name": "nope"}})
    assert status == 422 and "prompt" in err["error"]["message"], err
    status, _, body = tiny_stack.post_json("/tokenize", {"inputs": "hello",
                                                         "prompt_name": "query"})
    assert [t["text"] for t in body[0]] == ["[CLS]", "query", ":", "hello", "[SEP]"]
    _, _, info = tiny_stack.get("/info")
    [model] = json.loads(info)["models"]
    assert model["prompts"] == {"query": "query: "} and model["default_prompt"] is None
    status, _, err = tiny_stack.post_json("/v1/embeddings", {"input": "x",
                                                             "prompt_name": "passage"})
    assert status == 400 and "not one of model 'tiny''s prompts ('query')" in \
        err["error"]["message"]


def test_a_long_input_refused_by_the_requests_own_truncate_says_so(tiny_stack):
    status, _, err = tiny_stack.post_json("/embed", {"inputs": "word " * 200, "truncate": False})
    assert status == 413 and err["error"]["message"].endswith("(or send truncate: true)")
    # With no truncate in the request, the server's limits.truncate (false here) decided.
    status, _, err = tiny_stack.post_json("/embed", {"inputs": "word " * 200})
    assert status == 413 and err["error"]["message"].endswith("(or set limits.truncate)")


def test_rerank_validates_then_explains_it_needs_a_cross_encoder(tiny_stack):
    """On an embedding model; scores from a cross-encoder: tests/e2e/test_tasks.py."""
    status, _, err = tiny_stack.post_json("/rerank", {"query": "q"})
    assert status == 422 and err["error"]["param"] == "texts"
    status, _, err = tiny_stack.post_json("/rerank", {"query": "q", "texts": TEXTS,
                                                      "return_text": True})
    assert status == 404 and err["error"]["code"] == "model_not_found"
    assert "no rerank model is served" in err["error"]["message"]
    status, _, err = tiny_stack.post_json("/rerank", {"query": "q", "texts": TEXTS,
                                                      "model": "tiny"})
    assert status == 422 and err["error"]["code"] == "unsupported_task"
    assert "this route needs a rerank model" in err["error"]["message"]
    # TEI's texts and infinity's documents both: neither read silently (an outside check)
    status, _, err = tiny_stack.post_json("/rerank", {"query": "q", "texts": TEXTS,
                                                      "documents": TEXTS})
    assert status == 422 and err["error"]["param"] == "documents", err
    assert "not both" in err["error"]["message"]
    # a field sent null is not sent (clients that write unset fields so): TEI's, as before
    status, _, err = tiny_stack.post_json("/rerank", {"query": "q", "texts": TEXTS,
                                                      "documents": None, "model": "tiny"})
    assert status == 422 and err["error"]["code"] == "unsupported_task", err
    status, _, err = tiny_stack.post_json("/rerank", {"query": "q", "texts": None,
                                                      "documents": TEXTS, "model": "tiny"})
    assert status == 422 and err["error"]["code"] == "unsupported_task", err


def test_tokenize_in_teis_shape(tiny_stack, tiny_model):
    text = "héllo wörld"
    status, _, body = tiny_stack.post_json("/tokenize", {"inputs": text})
    assert status == 200 and len(body) == 1
    tokens = body[0]
    assert tokens[0] == {"id": 101, "text": "[CLS]", "special": True, "start": None,
                         "stop": None}
    assert tokens[-1]["text"] == "[SEP]" and tokens[-1]["special"]
    raw = text.encode()
    for token in tokens[1:-1]:  # byte offsets, as TEI gives them
        assert not token["special"]
        assert raw[token["start"]:token["stop"]].decode() == token["text"]
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    reference.no_padding()  # the shipped tokenizer.json pads to 128
    want = reference.encode(text).ids
    assert [t["id"] for t in tokens] == want
    status, _, body = tiny_stack.post_json("/tokenize", {"inputs": ["a b", "c"],
                                                         "add_special_tokens": False})
    assert status == 200 and [[t["text"] for t in row] for row in body] == [["a", "b"], ["c"]]


def test_token_ids_follow_the_requests_truncate_and_direction_as_texts(tiny_stack):
    ids = [101] + list(range(2000, 2100)) + [102]  # over the tiny model's 64 tokens
    status, _, err = tiny_stack.post_json("/embed", {"inputs": ids, "truncate": False})
    assert status == 413 and err["error"]["message"].endswith("(or send truncate: true)")
    status, _, err = tiny_stack.post_json("/embed", {"inputs": [ids]})  # limits.truncate false
    assert status == 413 and err["error"]["message"].endswith("(or set limits.truncate)")
    rows = {}  # cut between [CLS] and [SEP], as a text is
    for cut, kept in (("Right", [101] + ids[1:63] + [102]), ("Left", [101] + ids[-63:])):
        status, _, rows[cut] = tiny_stack.post_json("/embed", {
            "inputs": [ids], "truncate": True, "truncation_direction": cut})
        assert status == 200, rows[cut]
        status, _, want = tiny_stack.post_json("/embed", {"inputs": [kept]})
        np.testing.assert_allclose(rows[cut], want, atol=1e-6)
    assert not np.allclose(rows["Right"], rows["Left"], atol=1e-3)


def test_tokenize_is_never_truncated(tiny_stack):
    text = "ü " * 2500  # over the model's limit, and tokenized off the event loop
    status, _, body = tiny_stack.post_json("/tokenize", {"inputs": [text]})
    assert status == 200 and len(body[0]) == 2502
    assert body[0][-2] == {"id": body[0][1]["id"], "text": "ü", "special": False,
                           "start": 3 * 2499, "stop": 3 * 2499 + 2}


def test_tokenize_is_bounded_and_takes_the_headers_every_route_takes(tiny_stack):
    # At most limits.max_texts_per_request x the model's limit in all (64 x 64 here): a
    # request past it is refused before its answer is built (it grew a frontend past 2 GB).
    status, _, body = tiny_stack.post_json("/tokenize", {"inputs": ["ü " * 3000] * 2})
    assert status == 413 and "/tokenize answers at most 4096" in body["error"]["message"]
    status, _, body = tiny_stack.post_json("/tokenize", {"inputs": "hi"},
                                           {"X-Request-Timeout": "0.000001"})
    assert status == 504 and body["error"]["message"].startswith(
        "request deadline passed (X-Request-Timeout) (")
    for header in ({"X-Request-Timeout": "soon"}, {"X-Priority": "urgent!!"}):
        status, _, body = tiny_stack.post_json("/tokenize", {"inputs": "hi"}, header)
        assert status == 422 and body["error"]["param"] == next(iter(header)), body


def test_decode_turns_token_ids_back_into_text_as_the_tokenizer_does(tiny_stack):
    status, _, tokens = tiny_stack.post_json("/tokenize", {"inputs": ["hello world", "a b"]})
    rows = [[t["id"] for t in row] for row in tokens]
    status, _, body = tiny_stack.post_json("/decode", {"ids": rows})
    assert status == 200 and body == ["hello world", "a b"]
    status, _, body = tiny_stack.post_json("/decode", {"ids": rows[0],
                                                       "skip_special_tokens": False})
    assert status == 200 and body == ["[CLS] hello world [SEP]"]  # one list: still a list
    status, _, raw = tiny_stack.request(
        "POST", "/decode", msgpack.packb({"ids": rows[1]}),
        {"Content-Type": "application/msgpack", "Accept": "application/msgpack"})
    assert status == 200 and msgpack.unpackb(raw) == ["a b"]
    for bad, message in (({"ids": "hello"}, "'ids' must be a list of token ids"),
                         # these were told ids must be strings (an outside check)
                         ({"ids": None}, "'ids' must be a list of token ids"),
                         ({"ids": 1}, "'ids' must be a list of token ids"),
                         ({"ids": {}}, "'ids' must be a list of token ids"),
                         ({"ids": [[101, 10**6]]}, "'ids[0]' holds token id 1000000"),
                         ({"ids": [101, -1]}, "holds token id -1"),
                         ({"ids": [[101], []]}, "'ids[1]' must be a non-empty list"),
                         ({"ids": [101], "skip_special_tokens": "no"},
                          "'skip_special_tokens' must be a boolean"),
                         ({}, "'ids'")):
        status, _, err = tiny_stack.post_json("/decode", bad)
        assert status == 422 and message in err["error"]["message"], (bad, err)
    # Bounded as /tokenize is: limits.max_texts_per_request x the model's limit (64 x 64)
    status, _, err = tiny_stack.post_json("/decode", {"ids": [[1000] * 4097]})
    assert status == 413 and "/decode answers at most 4096" in err["error"]["message"]


def test_tokenize_msgpack(tiny_stack):
    status, _, raw = tiny_stack.request(
        "POST", "/tokenize", msgpack.packb({"inputs": "hello"}),
        {"Content-Type": "application/msgpack", "Accept": "application/msgpack"})
    assert status == 200 and [t["text"] for t in msgpack.unpackb(raw)[0]] == [
        "[CLS]", "hello", "[SEP]"]


def test_errors_keep_this_servers_shape_and_reach_hub(hub):
    with pytest.raises(HfHubHTTPError) as info:
        hub.feature_extraction(TEXTS, dimensions=999)
    assert info.value.response.status_code == 422
    body = json.loads(info.value.response.content)
    assert body["error"]["param"] == "dimensions"


def test_the_root_route_serves_the_client_pointed_at_the_server_itself(tiny_stack, native):
    """huggingface_hub's InferenceClient given the server's own URL (as TEI users point it)
    posts to `/`: feature extraction and sentence similarity must both work there."""
    with InferenceClient(model=tiny_stack.url) as client:
        got = client.feature_extraction(TEXTS)
        np.testing.assert_allclose(got, native, rtol=0, atol=1e-6)
        scores = client.sentence_similarity(TEXTS[0], other_sentences=TEXTS[1:])
    unit = native / np.linalg.norm(native, axis=1, keepdims=True)
    np.testing.assert_allclose(scores, unit[1:] @ unit[0], rtol=0, atol=1e-5)


def test_similarity_is_the_cosine_to_the_source_sentence(tiny_stack, native):
    body = {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}}
    status, _, got = tiny_stack.post_json("/similarity", body)
    assert status == 200, got
    unit = native / np.linalg.norm(native, axis=1, keepdims=True)
    np.testing.assert_allclose(got, unit[1:] @ unit[0], rtol=0, atol=1e-5)
    assert tiny_stack.post_json("/", body)[2] == got  # the root route dispatches it the same
    # float32's shortest decimal, as every vector is written, and a cosine never past 1 (a
    # text against itself came as 1.0000001192092896)
    same = {"inputs": {"source_sentence": TEXTS[0], "sentences": [TEXTS[0], *TEXTS[1:]]}}
    status, _, raw = tiny_stack.request("POST", "/similarity", json.dumps(same).encode(),
                                        {"Content-Type": "application/json"})
    tokens = raw.decode().strip("[]").split(",")
    assert all(str(np.float32(float(t))) == t for t in tokens), tokens
    assert 0.9999 <= float(tokens[0]) <= 1.0, tokens
    for bad in ({"inputs": {"source_sentence": 5, "sentences": ["a"]}},
                {"inputs": {"source_sentence": "a", "sentences": []}},
                {"inputs": {"sentences": ["a"]}},
                {"inputs": "a"}):
        status, _, err = tiny_stack.post_json("/similarity", bad)
        assert status == 422 and err["error"]["param"].startswith("inputs"), (bad, err)
    for bad, said in (({**body, "parameters": {"top_k": 2}}, "not a similarity parameter"),
                      ({**body, "parameters": "x"}, "must be an object"),
                      ({**body, "truncate": True, "parameters": {"truncate": False}},
                       "send it once")):
        status, _, err = tiny_stack.post_json("/similarity", bad)
        assert status == 422 and said in err["error"]["message"], (bad, err)
    # truncate in "parameters" is honoured (this stack's limits.truncate is false: an over-long
    # source is refused unless the request asks for it cut)
    long = {"inputs": {"source_sentence": "word " * 2000, "sentences": ["a"]}}
    assert tiny_stack.post_json("/similarity", long)[0] == 413
    status, _, got = tiny_stack.post_json("/similarity", {**long,
                                                          "parameters": {"truncate": True}})
    assert status == 200 and len(got) == 1, got
