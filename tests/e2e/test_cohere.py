"""Cohere's embed API with cohere's own Python clients (v1 `Client`, v2 `ClientV2`) pointed at
the server through nginx: the vectors are /predict's, every embedding type derived from them
as docs/protocols.md says, and Cohere's options map to this server's."""

import base64

import cohere
import numpy as np
import pytest

from frontend.cohere import PURPOSES, _prompt
from tests.e2e.test_api import TEXTS


@pytest.fixture(scope="module")
def queries(tiny_stack):
    """TEXTS as queries: the tiny model's "query" prompt before each (/predict)."""
    status, _, body = tiny_stack.post_json("/predict", {"texts": TEXTS, "prompt_name": "query"})
    assert status == 200
    return np.array(body["results"], dtype=np.float32)


# cohere's v1 client reads a pydantic attribute pydantic 2.11 deprecates
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_v1_embeds_floats_and_by_type(tiny_stack, native, queries):
    """input_type search_document: the model has no document prompt, so texts go as sent;
    search_query: its "query" prompt."""
    with cohere.Client(api_key="unused", base_url=tiny_stack.url) as v1:
        got = v1.embed(texts=TEXTS, model="tiny", input_type="search_document")
        assert got.response_type == "embeddings_floats" and got.texts == TEXTS
        np.testing.assert_allclose(np.array(got.embeddings, np.float32), native, atol=1e-6)
        assert got.meta.billed_units.input_tokens > len(TEXTS)
        got = v1.embed(texts=TEXTS, model="tiny", input_type="search_query",
                       embedding_types=["float", "ubinary"])
        assert got.response_type == "embeddings_by_type"
        np.testing.assert_allclose(np.array(got.embeddings.float_, np.float32), queries,
                                   atol=1e-6)
        assert got.embeddings.ubinary == np.packbits(queries > 0, axis=1).tolist()


def test_v2_gives_every_embedding_type(tiny_stack, native):
    with cohere.ClientV2(api_key="unused", base_url=tiny_stack.url) as v2:
        got = v2.embed(texts=TEXTS, model="tiny", input_type="clustering",
                       embedding_types=["float", "int8", "uint8", "binary", "ubinary",
                                        "base64"])
    e = got.embeddings
    np.testing.assert_allclose(np.array(e.float_, np.float32), native, atol=1e-6)
    decoded = np.stack([np.frombuffer(base64.b64decode(b), "<f4") for b in e.base64])
    np.testing.assert_allclose(decoded, native, atol=1e-6)
    int8 = np.array(e.int8)
    assert int8.min() >= -127 and int8.max() <= 127 and (np.abs(int8).max(1) == 127).all()
    assert (np.array(e.uint8) == int8 + 128).all()
    unit = native / np.linalg.norm(native, axis=1, keepdims=True)
    approx = int8 / np.linalg.norm(int8, axis=1, keepdims=True)
    assert (np.abs(approx @ approx.T - unit @ unit.T) < 0.01).all()  # cosine survives
    bits = np.packbits(native > 0, axis=1)
    assert e.ubinary == bits.tolist() and e.binary == (bits.astype(int) - 128).tolist()
    assert len(e.binary[0]) == native.shape[1] // 8
    assert got.meta.api_version.version == "2"
    # v2 answers by type even when no type is named: floats
    with cohere.ClientV2(api_key="unused", base_url=tiny_stack.url) as v2:
        got = v2.embed(texts=TEXTS[:1], model="tiny", input_type="classification",
                       output_dimension=8)
    short = np.array(got.embeddings.float_[0], np.float32)
    want = native[0, :8] / np.linalg.norm(native[0, :8])  # Matryoshka, normalised again
    np.testing.assert_allclose(short, want, atol=1e-6)
    # a whole float is that integer (JSON Schema's integer, the OpenAPI document's)
    status, _, body = tiny_stack.post_json("/v2/embed", {
        "texts": TEXTS[:1], "model": "tiny", "input_type": "classification",
        "output_dimension": 8.0, "priority": 2.0})
    assert status == 200, body
    np.testing.assert_allclose(body["embeddings"]["float"][0], want, atol=1e-6)


def test_truncate_options_and_refusals_in_our_error_shape(tiny_stack):
    long = "word " * 200  # past the tiny model's 64 tokens
    with cohere.ClientV2(api_key="unused", base_url=tiny_stack.url) as v2:
        end = v2.embed(texts=[long + "alpha"], model="tiny", input_type="clustering",
                       truncate="END").embeddings.float_[0]
        start = v2.embed(texts=["alpha " + long], model="tiny", input_type="clustering",
                         truncate="START").embeddings.float_[0]
        np.testing.assert_allclose(end, start, atol=1e-6)  # both cut to the same words
        # 400, as Cohere answers an invalid body or too many tokens: the client's
        # BadRequestError (413 and 422 were its bare ApiError, an outside check)
        for options, param in (({"truncate": "NONE"}, "texts"),
                               ({"images": ["data:image/png;base64,AAAA"]}, "images"),
                               ({"max_tokens": 8}, "max_tokens")):
            with pytest.raises(cohere.errors.BadRequestError) as info:
                v2.embed(texts=[long], model="tiny", input_type="search_query", **options)
            assert info.value.status_code == 400
            assert info.value.body["error"]["param"] == param  # not KServe's {"error": str}
            if param == "texts":  # this route's way to have it cut (it said "truncate: true"),
                # one every model takes (START is refused where a prompt's tokens would go)
                message = info.value.body["error"]["message"]
                assert "send truncate: END" in message and "START" not in message, message
        with pytest.raises(cohere.errors.BadRequestError) as info:
            v2.embed(texts=["x"] * 300, model="tiny", input_type="search_query")
        assert info.value.body["error"]["param"] == "texts"
        with pytest.raises(cohere.core.ApiError) as info:  # named as this route names it
            v2.embed(texts=["x"], model="tiny", input_type="search_query", output_dimension=33)
        assert info.value.body["error"]["param"] == "output_dimension"
    status, _, body = tiny_stack.post_json("/v2/embed", {"texts": ["x"],
                                                         "embedding_types": ["int4"]})
    assert status == 400 and body["error"]["param"] == "embedding_types", body
    status, _, body = tiny_stack.post_json("/v2/rerank", {"query": "q", "documents": []})
    assert status == 400, body
    status, _, body = tiny_stack.post_json("/v2/embed", {"texts": ["x"], "model": "nope"})
    assert status == 404 and body["error"]["code"] == "model_not_found", body


def test_input_type_picks_the_models_prompt_of_that_purpose():
    e5 = (("passage", "passage: "), ("query", "query: "))
    assert _prompt("search_query", e5) == "query"
    assert _prompt("search_document", e5) == "passage"
    assert _prompt("clustering", e5) is None  # none of that purpose: the model's default
    assert _prompt(None, e5) is None
    own = (("search_query", "q: "), ("query", "x: "))
    assert _prompt("search_query", own) == "search_query"  # its own name first
    assert set(PURPOSES) == {"search_query", "search_document", "classification", "clustering"}


def test_msgpack_floats_are_raw_float32_as_on_every_route(tiny_stack, native):
    import msgpack

    status, _, raw = tiny_stack.request(
        "POST", "/v2/embed", msgpack.packb({"texts": TEXTS, "model": "tiny",
                                            "embedding_types": ["float", "int8"]}),
        {"Content-Type": "application/msgpack", "Accept": "application/msgpack"})
    assert status == 200, raw
    body = msgpack.unpackb(raw)
    floats = np.stack([np.frombuffer(b, "<f4") for b in body["embeddings"]["float"]])
    np.testing.assert_allclose(floats, native, atol=1e-6)
    assert len(body["embeddings"]["int8"]) == len(TEXTS)
