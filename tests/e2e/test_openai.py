"""OpenAI's /v1/embeddings, complete, with the openai client and langchain-openai."""

import base64

import msgpack
import numpy as np
import openai
import pytest
from langchain_openai import OpenAIEmbeddings
from tokenizers import Tokenizer

from tests.e2e.test_api import TEXTS


@pytest.fixture(scope="module")
def client(tiny_stack):
    with openai.OpenAI(base_url=tiny_stack.url + "/v1", api_key="unused",
                       max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    tok.no_padding()
    return tok


def rows(response):
    # The client decodes base64 itself only when it chose it; asked for, it is left as is.
    return np.array([np.frombuffer(base64.b64decode(d.embedding), "<f4")
                     if isinstance(d.embedding, str) else d.embedding for d in response.data],
                    dtype=np.float32)


def test_models_are_listed_and_retrieved(client, tiny_model):
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    # `created`: when its weights were written, the same on every frontend (it was 0)
    written = int((tiny_model / "model.safetensors").stat().st_mtime)
    assert [client.models.retrieve("tiny").created for _ in range(4)] == [written] * 4
    assert client.models.retrieve("test-org/tiny").id == "tiny"  # an alias names the model
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert info.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_string_and_list_input(client, native, encoding_format):
    one = client.embeddings.create(model="tiny", input=TEXTS[1], user="user-1",
                                   encoding_format=encoding_format)
    np.testing.assert_allclose(rows(one), native[1:2], rtol=0, atol=1e-6)
    many = client.embeddings.create(model="tiny", input=TEXTS, encoding_format=encoding_format)
    np.testing.assert_allclose(rows(many), native, rtol=0, atol=1e-6)


def test_token_ids_are_used_as_given(client, native, tokenizer):
    # With the special tokens the tokenizer adds, ids give exactly what the text gives.
    ids = [tokenizer.encode(t).ids for t in TEXTS]
    resp = client.embeddings.create(model="tiny", input=ids)
    np.testing.assert_allclose(rows(resp), native, rtol=0, atol=1e-6)
    assert resp.usage.prompt_tokens == sum(map(len, ids))
    one = client.embeddings.create(model="tiny", input=ids[2])
    np.testing.assert_allclose(rows(one), native[2:3], rtol=0, atol=1e-6)
    # Without them the vector would be no text's: refused, naming the frame (tiktoken's ids,
    # which langchain-openai sends by default, were embedded as other tokens, silently).
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="tiny", input=ids[2][1:-1])
    said = str(info.value)
    assert "'input[0]' does not begin with [101] and end with [102]" in said, said
    assert "langchain-openai sends those" in said


def test_dimensions_keeps_a_renormalised_prefix(client, native):
    resp = client.embeddings.create(model="tiny", input=TEXTS, dimensions=8)
    got = rows(resp)
    want = native[:, :8] / np.linalg.norm(native[:, :8], axis=1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    full = client.embeddings.create(model="tiny", input=TEXTS, dimensions=32)
    np.testing.assert_allclose(rows(full), native, rtol=0, atol=1e-6)


def test_msgpack_vectors_are_raw_float32(tiny_stack, native):
    status, headers, raw = tiny_stack.request(
        "POST", "/v1/embeddings", msgpack.packb({"input": TEXTS, "dimensions": 8}),
        {"Content-Type": "application/msgpack", "Accept": "application/msgpack"})
    assert status == 200 and headers["Content-Type"].startswith("application/msgpack")
    got = np.stack([np.frombuffer(d["embedding"], "<f4") for d in msgpack.unpackb(raw)["data"]])
    want = native[:, :8] / np.linalg.norm(native[:, :8], axis=1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kwargs,error,param,code", [
    ({"dimensions": 33}, openai.BadRequestError, "dimensions", None),
    ({"dimensions": 0}, openai.BadRequestError, "dimensions", None),
    ({"input": [[1, 30522]]}, openai.BadRequestError, "input", None),
    ({"input": [[]]}, openai.BadRequestError, "input", None),
    # Over a limit (truncate is off; 64 texts a request): 413 elsewhere, 400 here, where
    # the client raised a bare APIStatusError that code catching BadRequestError missed.
    ({"input": [[101] + [5] * 63 + [102]]}, openai.BadRequestError, "input", None),
    ({"input": ["x"] * 65}, openai.BadRequestError, "input", None),
    ({"model": "gpt-9"}, openai.NotFoundError, "model", "model_not_found"),
])
def test_errors_in_openais_shape(client, kwargs, error, param, code):
    with pytest.raises(error) as info:
        client.embeddings.create(**{"model": "tiny", "input": "x", **kwargs})
    exc = info.value
    assert exc.param == param and exc.code == code and exc.type
    assert set(exc.body) == {"message", "type", "param", "code"}
    if kwargs.get("input") in ([[101] + [5] * 63 + [102]], ["x"] * 65):
        assert exc.status_code == 400 and exc.type == "too_large"


def langchain(tiny_stack, sync, async_, **kwargs) -> OpenAIEmbeddings:
    """OpenAIEmbeddings over HTTP clients the test owns and closes (its own it never closes).

    check_embedding_ctx_length=False: otherwise langchain tokenizes with tiktoken (a download,
    and OpenAI's vocabulary, not the model's) and sends those token ids."""
    return OpenAIEmbeddings(**{"model": "tiny", **kwargs}, base_url=tiny_stack.url + "/v1",
                            api_key="unused", check_embedding_ctx_length=False, max_retries=0,
                            http_client=sync, http_async_client=async_)


@pytest.fixture
async def http_clients():
    sync, async_ = openai.DefaultHttpxClient(), openai.DefaultAsyncHttpxClient()
    yield sync, async_
    sync.close()
    await async_.aclose()


def test_langchain_openai_embeddings(tiny_stack, native, http_clients):
    embeddings = langchain(tiny_stack, *http_clients)
    got = np.array(embeddings.embed_documents(TEXTS), dtype=np.float32)
    np.testing.assert_allclose(got, native, rtol=0, atol=1e-6)
    got = np.array(embeddings.embed_query(TEXTS[0]), dtype=np.float32)
    np.testing.assert_allclose(got, native[0], rtol=0, atol=1e-6)
    got = np.array(langchain(tiny_stack, *http_clients, dimensions=16).embed_query(TEXTS[0]),
                   dtype=np.float32)
    assert got.shape == (16,) and abs(np.linalg.norm(got) - 1) < 1e-5


async def test_langchain_async(tiny_stack, native, http_clients):
    embeddings = langchain(tiny_stack, *http_clients, model="tiny-alias")
    got = np.array(await embeddings.aembed_documents(TEXTS[:2]), dtype=np.float32)
    np.testing.assert_allclose(got, native[:2], rtol=0, atol=1e-6)
