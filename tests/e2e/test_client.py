"""shmserve.client against the real stack: sync and async, msgpack and JSON, typed errors."""

import numpy as np
import pytest

from shmserve.client import AsyncClient, Client, ShmserveError
from tests.e2e.test_api import TEXTS


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_sync_client(tiny_stack, native, fmt):
    with Client(tiny_stack.url, format=fmt, timeout=20) as client:
        got = client.embed(TEXTS)
        assert got.dtype == np.float32 and got.shape == (4, 32)
        np.testing.assert_allclose(got, native, rtol=0, atol=1e-6)
        one = client.embed(TEXTS[0], model="tiny-alias")
        assert one.shape == (32,)
        np.testing.assert_allclose(one, native[0], rtol=0, atol=1e-6)
        assert client.models() == ["tiny"] and client.ready()
        for _ in range(3):  # one keep-alive connection serves them all
            client.embed(TEXTS[:1])


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_async_client(tiny_stack, native, fmt):
    async with AsyncClient(tiny_stack.url, format=fmt, model="tiny") as client:
        got = await client.embed(TEXTS)
        np.testing.assert_allclose(got, native, rtol=0, atol=1e-6)
        assert (await client.embed("hello")).shape == (32,)
        assert await client.models() == ["tiny"] and await client.ready()


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_token_embeddings(tiny_stack, fmt):
    """embed_tokens: /embed_all's rows, a [tokens, dim] array per text; their count is the
    text's tokens as /tokenize gives them, and a prompt adds its own."""
    _, _, tokens = tiny_stack.post_json("/tokenize", {"inputs": TEXTS})
    with Client(tiny_stack.url, format=fmt) as client:
        got = client.embed_tokens(TEXTS)
        assert [a.shape for a in got] == [(len(t), 32) for t in tokens]
        assert all(a.dtype == np.float32 for a in got)
        one = client.embed_tokens(TEXTS[1])
        np.testing.assert_allclose(one, got[1], rtol=0, atol=1e-6)
        prompted = client.embed_tokens(TEXTS[1], prompt_name="query")
        assert prompted.shape[0] > one.shape[0]
    async with AsyncClient(tiny_stack.url, format=fmt) as client:
        again = await client.embed_tokens(TEXTS)
    for a, b in zip(again, got):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_a_prompt_by_name(tiny_stack, fmt):
    """tiny's prompts: {"query": "query: "} (tests/conftest.py)."""
    with Client(tiny_stack.url, format=fmt) as client:
        want = client.embed(["query: " + t for t in TEXTS])
        np.testing.assert_allclose(client.embed(TEXTS, prompt_name="query"), want,
                                   rtol=0, atol=1e-6)
        with pytest.raises(ShmserveError) as info:
            client.embed(TEXTS, prompt_name="passage")
        assert info.value.status == 422 and info.value.param == "prompt_name"
    async with AsyncClient(tiny_stack.url, format=fmt) as client:
        np.testing.assert_allclose(await client.embed(TEXTS, prompt_name="query"), want,
                                   rtol=0, atol=1e-6)


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_errors_carry_status_and_body(tiny_stack, fmt):
    with Client(tiny_stack.url, format=fmt) as client:
        with pytest.raises(ShmserveError) as info:
            client.embed(["x"], model="gpt-9")
        err = info.value
        assert err.status == 404 and err.code == "model_not_found" and err.param == "model"
        assert err.body["error"]["type"] == "not_found" == err.type
        with pytest.raises(ShmserveError) as info:
            client.embed([])
        assert info.value.status == 422 and info.value.param == "texts"


def test_a_passed_deadline_comes_back_as_the_servers_504(tiny_stack):
    # The client waits a margin past the deadline it sends, so the server's answer arrives
    # (before, the client's own socket timeout fired first, with no status).
    with Client(tiny_stack.url, timeout=0.000001) as client:
        with pytest.raises(ShmserveError) as info:
            client.embed(["late"] * 8)
    assert info.value.status == 504 and info.value.type == "timeout"


async def test_async_errors_carry_status_and_body(tiny_stack):
    async with AsyncClient(tiny_stack.url) as client:
        with pytest.raises(ShmserveError) as info:
            await client.embed(["word " * 200])
        assert info.value.status == 413 and info.value.type == "too_large"
