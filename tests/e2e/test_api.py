"""The public API through nginx on the tiny model, with real clients."""

import asyncio
import base64
import http.client
import json

import aiohttp
import msgpack
import numpy as np
import openai
from prometheus_client.parser import text_string_to_metric_families

from shmserve.protocol import PROTOCOL_VERSION
from tests.conftest import TINY_MAX_TOKENS
from tests.tinymodel import reference_embeddings

TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello",
         "Shared memory moves token ids between processes without copies.",
         "An embedding is a vector that represents a piece of text."]


def test_health_ready_models(tiny_stack):
    status, headers, body = tiny_stack.get("/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert json.loads(body)["protocol"] == PROTOCOL_VERSION  # asked by restart (versions)
    status, _, body = tiny_stack.get("/ready")
    ready = json.loads(body)
    assert status == 200 and ready["status"] == "ready"
    assert [w["ready"] for w in ready["workers"]] == [True]
    assert [w["protocol"] for w in ready["workers"]] == [PROTOCOL_VERSION]
    status, _, body = tiny_stack.get("/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["tiny"]


def test_predict_json_matches_transformers(tiny_stack, tiny_model):
    status, headers, body = tiny_stack.post_json("/predict", {"texts": TEXTS})
    assert status == 200, body
    got = np.array(body["results"], dtype=np.float32)
    want = reference_embeddings(tiny_model, TEXTS, TINY_MAX_TOKENS)
    assert got.shape == (4, 32)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert body["model"] == "tiny" and body["revision"] == "tiny-r1"
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 4
    assert headers["X-Model-Revision"] == "tiny-r1"
    assert 1 <= int(headers["X-Batch-Size"]) <= 4
    # TEI's usage headers (an outside check against its server: none were sent)
    assert headers["X-Compute-Type"] == "cpu"
    assert int(headers["X-Compute-Characters"]) == sum(map(len, TEXTS))
    assert int(headers["X-Compute-Tokens"]) == body["usage"]["total_tokens"]
    assert int(headers["X-Compute-Time"]) == int(float(headers["X-Total-Time"]))


def test_predict_msgpack_both_ways(tiny_stack, tiny_model):
    for ctype in ("application/msgpack", "application/x-msgpack"):
        status, headers, raw = tiny_stack.request(
            "POST", "/predict", msgpack.packb({"texts": TEXTS[:2], "model": "tiny-alias"}),
            {"Content-Type": ctype, "Accept": ctype})
        assert status == 200, raw
        assert headers["Content-Type"].startswith("application/msgpack")
        body = msgpack.unpackb(raw)
        got = np.stack([np.frombuffer(v, "<f4") for v in body["results"]])
        np.testing.assert_allclose(got, reference_embeddings(tiny_model, TEXTS[:2],
                                                             TINY_MAX_TOKENS), atol=1e-5)


def test_predict_takes_one_string_as_one_text(tiny_stack, tiny_model):
    # As /v1/embeddings answers "input": "hello" with a `data` of one: `results` of one row.
    status, _, body = tiny_stack.post_json("/predict", {"texts": "hello"})
    assert status == 200, body
    np.testing.assert_allclose(np.array(body["results"], dtype=np.float32),
                               reference_embeddings(tiny_model, ["hello"], TINY_MAX_TOKENS),
                               atol=1e-5)
    _, _, openai_body = tiny_stack.post_json("/v1/embeddings", {"input": "hello"})
    assert len(openai_body["data"]) == len(body["results"]) == 1


def test_json_in_msgpack_out(tiny_stack):
    status, headers, raw = tiny_stack.request(
        "POST", "/predict", json.dumps({"texts": ["x"]}).encode(),
        {"Content-Type": "application/json", "Accept": "application/msgpack"})
    assert status == 200
    assert len(msgpack.unpackb(raw)["results"][0]) == 32 * 4
    # IANA's msgpack type in, Accept read case-insensitively and with its q values.
    for accept, packed in (("Application/MsgPack", True), ("application/msgpack;q=0", False),
                           ("application/json, application/msgpack;q=0.1", False)):
        status, headers, raw = tiny_stack.request(
            "POST", "/predict", msgpack.packb({"texts": ["x"]}),
            {"Content-Type": "application/vnd.msgpack", "Accept": accept})
        assert status == 200, raw
        assert headers["Content-Type"].startswith(
            "application/msgpack" if packed else "application/json")


def test_openai_client_float_and_base64(tiny_stack, tiny_model):
    client = openai.OpenAI(base_url=tiny_stack.url + "/v1", api_key="unused", max_retries=0)
    want = reference_embeddings(tiny_model, TEXTS, TINY_MAX_TOKENS)
    # The client asks for base64 by default and decodes it itself.
    resp = client.embeddings.create(model="tiny", input=TEXTS)
    got = np.array([d.embedding for d in resp.data], dtype=np.float32)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert [d.index for d in resp.data] == [0, 1, 2, 3]
    assert resp.model == "tiny" and resp.usage.prompt_tokens > 0
    resp = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(resp.data[0].embedding, want[0], atol=1e-5)


def test_embeddings_base64_is_little_endian_float32(tiny_stack, tiny_model):
    status, _, body = tiny_stack.post_json("/v1/embeddings", {"input": "hello",
                                                              "encoding_format": "base64"})
    assert status == 200
    vec = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vec, reference_embeddings(tiny_model, ["hello"],
                                                         TINY_MAX_TOKENS)[0], atol=1e-5)
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"


def test_request_id_and_timing_headers(tiny_stack):
    _, headers, _ = tiny_stack.post_json("/predict", {"texts": ["a"]},
                                         {"X-Request-ID": "client-id-123"})
    assert headers["X-Request-ID"] == "client-id-123"
    assert float(headers["X-Process-Time"]) >= 0
    _, h1, _ = tiny_stack.get("/health")
    _, h2, _ = tiny_stack.get("/health")
    assert len(h1["X-Request-ID"]) >= 16 and h1["X-Request-ID"] != h2["X-Request-ID"]


def test_metrics_parse_and_count_requests(tiny_stack):
    def predict_200s():
        _, _, raw = tiny_stack.get("/metrics")
        for family in text_string_to_metric_families(raw.decode()):
            for sample in family.samples:
                if sample.name == "shmserve_requests_total" and sample.labels == {
                        "route": "/predict", "model": "tiny", "status": "200",
                        "revision": "tiny-r1"}:
                    return sample.value
        return 0.0

    before = predict_200s()
    for _ in range(5):
        assert tiny_stack.post_json("/predict", {"texts": ["count me"]})[0] == 200
    # summed over both frontends, once they are there (Stack.settled: CI saw 4), never more
    assert tiny_stack.settled(predict_200s, lambda n: n - before >= 5) - before == 5
    _, headers, raw = tiny_stack.get("/metrics")
    names = {f.name for f in text_string_to_metric_families(raw.decode())}
    assert {"shmserve_requests", "shmserve_request_duration_seconds"} <= names


def test_200_concurrent_mixed_requests_get_their_own_vectors(tiny_stack):
    corpus = [("word " * (1 + i % 50)).strip() + f" {i}" for i in range(60)]
    rng = np.random.default_rng(0)
    requests = [list(rng.choice(corpus, size=int(rng.integers(1, 9)))) for _ in range(200)]

    async def run():
        async with aiohttp.ClientSession(tiny_stack.url) as session:
            async def one(texts):
                async with session.post("/predict", json={"texts": texts}) as resp:
                    assert resp.status == 200, await resp.text()
                    return np.array((await resp.json())["results"], dtype=np.float32)

            single = {t: (await one([t]))[0] for t in corpus}  # one at a time
            results = await asyncio.gather(*(one(r) for r in requests))
            return single, results

    single, results = asyncio.run(run())
    for texts, got in zip(requests, results):
        assert got.shape == (len(texts), 32)
        for text, row in zip(texts, got):
            np.testing.assert_allclose(row, single[text], atol=1e-5)


def test_a_body_without_content_type_or_with_an_empty_one_is_json(tiny_stack):
    """curl -d sends form encoding, a bare client often sends nothing, some send the header
    empty: absent and empty both read as JSON; a declared other type is refused (415)."""
    body = json.dumps({"texts": ["no content type"]}).encode()
    for headers in ({}, {"Content-Type": ""}):
        conn = http.client.HTTPConnection("127.0.0.1", tiny_stack.port, timeout=30)
        try:
            conn.putrequest("POST", "/predict", skip_accept_encoding=True)
            for name, value in headers.items():
                conn.putheader(name, value)
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            response = conn.getresponse()
            answer = json.loads(response.read())
        finally:
            conn.close()
        assert response.status == 200, (headers, answer)
        assert len(answer["results"]) == 1
    status, _, answer = tiny_stack.request("POST", "/predict", body,
                                           {"Content-Type": "text/plain"})
    assert status == 415
