"""KServe v2 through nginx with Triton's own HTTP client, and its bodies by hand."""

import http.client
import json
import struct
import time

import msgpack
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.e2e.test_api import TEXTS


@pytest.fixture(scope="module")
def client(tiny_stack):
    with triton.InferenceServerClient(tiny_stack.url.removeprefix("http://")) as client:
        yield client


def text_input(texts, binary, shape=None):
    tensor = triton.InferInput("text", shape or [len(texts)], "BYTES")
    data = np.array([t.encode() for t in texts], dtype=np.object_)
    tensor.set_data_from_numpy(data.reshape(shape or [len(texts)]), binary_data=binary)
    return tensor


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tiny") and client.is_model_ready("tiny-alias")
    assert client.is_model_ready("tiny", model_version="tiny-r1")
    assert not client.is_model_ready("nope")
    assert not client.is_model_ready("tiny", model_version="2")
    server = client.get_server_metadata()
    assert server["name"] == "shmserve" and "binary_tensor_data" in server["extensions"]
    meta = client.get_model_metadata("tiny-alias")
    assert meta == {"name": "tiny", "versions": ["tiny-r1"], "platform": "shmserve",
                    "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
                    "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [-1, 32]}]}
    assert client.get_model_metadata("tiny", model_version="tiny-r1")["name"] == "tiny"


@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False])
def test_infer_equals_the_native_api(client, native, binary_in, binary_out):
    result = client.infer("tiny", [text_input(TEXTS, binary_in)],
                          outputs=[triton.InferRequestedOutput("embedding",
                                                               binary_data=binary_out)],
                          request_id="kserve-1")
    got = result.as_numpy("embedding")
    assert got.dtype == np.float32 and got.shape == (4, 32)
    np.testing.assert_allclose(got, native, rtol=0, atol=1e-6)
    response = result.get_response()
    assert response["model_name"] == "tiny" and response["model_version"] == "tiny-r1"
    assert response["id"] == "kserve-1"
    assert ("parameters" in response["outputs"][0]) == binary_out


def test_infer_without_outputs_gets_binary_and_batch_dimension_is_accepted(client, native):
    # No outputs named: the client asks binary_data_output for all of them.
    result = client.infer("tiny", [text_input(TEXTS, True, shape=[4, 1])],
                          model_version="tiny-r1")
    np.testing.assert_allclose(result.as_numpy("embedding"), native, rtol=0, atol=1e-6)
    # a shape neither takes names both (it named [-1] alone: an outside check)
    with pytest.raises(InferenceServerException) as info:
        client.infer("tiny", [text_input(TEXTS, True, shape=[2, 2])])
    assert "has shape [2, 2]; expected [-1] (-1: any size) or [-1, 1]" in str(info.value)


@pytest.mark.parametrize("name,datatype,model,status,needle", [
    ("texts", "BYTES", "tiny", "422", "inputs must be exactly"),
    ("text", "FP32", "tiny", "422", "must be BYTES"),
    ("text", "BYTES", "nope", "404", "not served"),
])
def test_infer_errors_reach_the_client(client, name, datatype, model, status, needle):
    tensor = triton.InferInput(name, [1], datatype)
    tensor.set_data_from_numpy(np.array([b"x"] if datatype == "BYTES" else [1.0],
                                        dtype=np.object_ if datatype == "BYTES" else np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, [tensor])
    assert info.value.status() == status and needle in info.value.message()
    # The client builds its text as "[" + status + "] " + the body's "error": a string.
    assert str(info.value).startswith(f"[{status}] ") and needle in str(info.value)


def test_tritons_priority_and_timeout_are_honoured(client, tiny_stack, native):
    result = client.infer("tiny", [text_input(TEXTS, True)], priority=1, timeout=30_000_000)
    np.testing.assert_allclose(result.as_numpy("embedding"), native, rtol=0, atol=1e-6)
    # A timeout of 1 microsecond has passed before any worker sees the request: 504.
    with pytest.raises(InferenceServerException) as info:
        client.infer("tiny", [text_input(TEXTS, True)], timeout=1)
    assert info.value.status() == "504"
    # named as what set it: this parameter, not X-Request-Timeout (an outside check)
    assert info.value.message().startswith("request deadline passed (parameters.timeout) (")
    with pytest.raises(InferenceServerException) as info:
        client.infer("tiny", [text_input(TEXTS, True)], timeout=30_000_000,
                     headers={"X-Request-Timeout": "0.000001"})
    assert info.value.message().startswith("request deadline passed (X-Request-Timeout) (")
    status, _, raw = tiny_stack.request("POST", "/v2/models/tiny/infer", json.dumps({
        "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["x"]}],
        "parameters": {"priority": "bogus"}}).encode(), {"Content-Type": "application/json"})
    assert status == 422 and "parameters.priority" in json.loads(raw)["error"]


@pytest.mark.parametrize("method,path,body,status", [
    ("POST", "/v2/models/nope/infer", b'{"inputs": []}', 404),
    ("POST", "/v2/models/tiny/infer", b'{"inputs": [', 400),
    ("POST", "/v2/models/tiny/infer", b"\xc1", 400),  # msgpack, by Content-Type below
    ("GET", "/v2/models/tiny/versions/9", None, 404),
    ("GET", "/v2/no/such/route", None, 404),
    ("DELETE", "/v2", None, 405),
])
@pytest.mark.parametrize("accept", ["application/json", "application/msgpack"])
def test_every_v2_error_is_a_string(tiny_stack, method, path, body, status, accept):
    ctype = "application/msgpack" if body == b"\xc1" else "application/json"
    got, headers, raw = tiny_stack.request(method, path, body, {
        "Content-Type": ctype, "Accept": accept, "X-Request-ID": "kserve-err-1"})
    error = msgpack.unpackb(raw) if "msgpack" in accept else json.loads(raw)
    assert got == status and set(error) == {"error"} and isinstance(error["error"], str)
    assert error["error"] and headers["X-Request-ID"] == "kserve-err-1"


def test_model_config_is_tritons_and_subroutes_are_not_model_names(client, tiny_stack):
    config = client.get_model_config("test-org/tiny")  # an alias holding '/'
    assert config == {
        "name": "tiny", "platform": "shmserve", "backend": "shmserve", "max_batch_size": 64,
        "input": [{"name": "text", "data_type": "TYPE_STRING", "dims": [1],
                   "reshape": {"shape": []}}],
        "output": [{"name": "embedding", "data_type": "TYPE_FP32", "dims": [32]}]}
    assert client.get_model_config("tiny", model_version="tiny-r1") == config
    assert "model_configuration" in client.get_server_metadata()["extensions"]
    with pytest.raises(InferenceServerException, match="not served"):
        client.get_model_config("nope")
    # GET on the infer route is its 405, not the metadata of a model named "tiny/infer".
    for path in ("/v2/models/tiny/infer", "/v2/models/tiny/versions/tiny-r1/infer"):
        status, headers, raw = tiny_stack.request("GET", path, None)
        assert status == 405 and headers["Allow"] == "POST", raw
        assert isinstance(json.loads(raw)["error"], str)
    status, headers, _ = tiny_stack.request("OPTIONS", "/v2/models/tiny/infer", None)
    assert status == 405 and headers["Allow"] == "POST"
    # A form body (curl -d without a Content-Type) is refused as on every other route.
    body = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                   "data": ["x"]}]}).encode()
    status, _, raw = tiny_stack.request("POST", "/v2/models/tiny/infer", body,
                                        {"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 415 and "application/json" in json.loads(raw)["error"]
    assert tiny_stack.request("POST", "/v2/models/tiny/infer", body,
                              {"Content-Type": "application/json"})[0] == 200


def test_statistics_count_what_every_protocol_ran(client, tiny_stack):
    """Triton's statistics (GET /v2/models/stats) as tritonclient reads them: what the
    frontends and workers counted, the same whichever frontend answers, by version."""
    assert "statistics" in client.get_server_metadata()["extensions"]

    def tiny() -> dict:
        [stat] = client.get_inference_statistics("tiny")["model_stats"]
        return stat

    before, started_ms = tiny(), time.time() * 1000
    for _ in range(3):  # 3 requests of 2 texts over KServe, 1 of 3 over OpenAI's API
        client.infer("tiny", [text_input(["one text", "another, longer text"], True)])
    status, headers, _ = tiny_stack.request("POST", "/v1/embeddings", json.dumps(
        {"model": "test-org/tiny", "input": ["a", "b c", "d e f"]}).encode(),
        {"Content-Type": "application/json"})
    assert status == 200
    with pytest.raises(InferenceServerException):  # a deadline passed: a failure
        client.infer("tiny", [text_input(["late"], True)], timeout=1)
    # once the failure is in them (Stack.settled: CI saw fail 0)
    after = tiny_stack.settled(tiny, lambda now: now["inference_stats"]["fail"]["count"]
                               > before["inference_stats"]["fail"]["count"])
    assert after["name"] == "tiny" and after["version"] == headers["X-Model-Revision"]

    def grew(*path) -> int:
        new, old = after, before
        for key in path:
            new, old = new[key], old[key]
        return new - old

    assert grew("inference_count") == 9
    assert grew("inference_stats", "success", "count") == 4
    assert grew("inference_stats", "fail", "count") == 1 and grew("inference_stats", "fail", "ns")
    parts = ("queue", "compute_input", "compute_infer", "compute_output")
    assert [grew("inference_stats", part, "count") for part in parts] == [4] * 4
    spent = [grew("inference_stats", part, "ns") for part in parts]
    assert all(ns > 0 for ns in spent) and grew("inference_stats", "success", "ns") > sum(spent)
    assert after["inference_stats"]["cache_hit"] == {"count": 0, "ns": 0}
    assert after["last_inference"] >= started_ms
    # every text ran in one pass: the passes' sizes add up to the texts
    sizes = {b["batch_size"]: b["compute_infer"] for b in after["batch_stats"]}
    old_sizes = {b["batch_size"]: b["compute_infer"] for b in before["batch_stats"]}
    passes = {size: got["count"] - old_sizes.get(size, {"count": 0})["count"]
              for size, got in sizes.items()}
    assert sum(size * n for size, n in passes.items()) == 9 and 1 <= sum(passes.values()) <= 4
    assert grew("execution_count") == sum(passes.values())
    assert all(got["ns"] > 0 for got in sizes.values())
    # every model's, one version's, an alias's; the same numbers from any frontend
    every = client.get_inference_statistics()["model_stats"]
    assert after in every and {s["name"] for s in every} == {"tiny"}
    assert client.get_inference_statistics("tiny", "tiny-r1")["model_stats"] == [after]
    assert client.get_inference_statistics("test-org/tiny")["model_stats"] == [after]
    for name, version in (("nope", ""), ("tiny", "9")):
        with pytest.raises(InferenceServerException) as info:
            client.get_inference_statistics(name, version)
        assert "[404]" in str(info.value)
    # kept from /metrics: the histograms there say the same without a series per batch size
    _, _, scraped = tiny_stack.request("GET", "/metrics", None)
    assert b"shmserve_stage_duration_seconds" in scraped and b"shmserve_stats_" not in scraped


def test_the_repository_index_lists_every_model_and_load_and_unload_are_refused(client,
                                                                                tiny_stack):
    """Triton's model repository extension: the index as tritonclient reads it; load and
    unload refused with what to do instead (the config says what is served)."""
    assert "model_repository" in client.get_server_metadata()["extensions"]
    assert client.get_model_repository_index() == [
        {"name": "tiny", "version": "tiny-r1", "state": "READY"}]
    status, _, raw = tiny_stack.request("POST", "/v2/repository/index", b'{"ready": true}',
                                        {"Content-Type": "application/json"})
    assert status == 200 and json.loads(raw) == client.get_model_repository_index()
    for body in (b'{"ready": 1}', b"[1]", b"{"):
        status, _, raw = tiny_stack.request("POST", "/v2/repository/index", body,
                                            {"Content-Type": "application/json"})
        assert status in (400, 422) and isinstance(json.loads(raw)["error"], str), raw
    for change in (client.load_model, client.unload_model):
        with pytest.raises(InferenceServerException) as info:
            change("test-org/tiny")
        assert info.value.status() == "400" and "shmserve apply" in info.value.message()
        assert "POST /admin/models/tiny/reload" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            change("nope")
        assert info.value.status() == "404"


def test_wrong_version_is_404(client):
    with pytest.raises(InferenceServerException) as info:
        client.infer("tiny", [text_input(["x"], True)], model_version="7")
    assert info.value.status() == "404"


def test_binary_request_by_hand(tiny_stack, native):
    elements = b"".join(struct.pack("<I", len(t.encode())) + t.encode() for t in TEXTS)
    header = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [4],
                                     "parameters": {"binary_data_size": len(elements)}}],
                         "outputs": [{"name": "embedding",
                                      "parameters": {"binary_data": True}}]}).encode()
    status, headers, raw = tiny_stack.request(
        "POST", "/v2/models/tiny/infer", header + elements,
        {"Inference-Header-Content-Length": str(len(header)),
         "Content-Type": "application/octet-stream"})
    assert status == 200, raw
    n = int(headers["Inference-Header-Content-Length"])
    assert headers["Content-Type"].startswith("application/octet-stream")
    out = json.loads(raw[:n])["outputs"][0]
    assert out["parameters"]["binary_data_size"] == len(raw) - n == 4 * 32 * 4
    np.testing.assert_allclose(np.frombuffer(raw[n:], "<f4").reshape(4, 32), native, atol=1e-6)
    assert headers["X-Model-Revision"] == "tiny-r1"
    # The length sent twice, the second wrong: refused, not the first taken (an outside check)
    conn = http.client.HTTPConnection("127.0.0.1", tiny_stack.port, timeout=60)
    conn.putrequest("POST", "/v2/models/tiny/infer")
    for value in (len(header), 3):
        conn.putheader("Inference-Header-Content-Length", str(value))
    conn.putheader("Content-Type", "application/octet-stream")
    conn.putheader("Content-Length", str(len(header + elements)))
    conn.endheaders(header + elements)
    answer = conn.getresponse()
    error = json.loads(answer.read())["error"]
    conn.close()
    assert answer.status == 400 and f"is '{len(header)}, 3'" in error, (answer.status, error)


def test_msgpack_both_ways(tiny_stack, native):
    body = msgpack.packb({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [4],
                                      "data": TEXTS}]})
    status, headers, raw = tiny_stack.request(
        "POST", "/v2/models/tiny/infer", body,
        {"Content-Type": "application/msgpack", "Accept": "application/msgpack"})
    assert status == 200, raw
    out = msgpack.unpackb(raw)["outputs"][0]
    assert out["shape"] == [4, 32] and out["datatype"] == "FP32"
    np.testing.assert_allclose(np.frombuffer(out["data"], "<f4").reshape(4, 32), native,
                               atol=1e-6)


def test_model_names_with_a_slash(client, tiny_stack, native):
    # Triton's client sends the name unescaped: /v2/models/test-org/tiny/...
    assert client.is_model_ready("test-org/tiny")
    assert client.get_model_metadata("test-org/tiny", model_version="tiny-r1")["name"] == "tiny"
    result = client.infer("test-org/tiny", [text_input(TEXTS, True)])
    np.testing.assert_allclose(result.as_numpy("embedding"), native, rtol=0, atol=1e-6)
    status, _, raw = tiny_stack.get("/v2/models/other-org/tiny")
    assert status == 404 and json.loads(raw) == {
        "error": "model 'other-org/tiny' is not served; see GET /v1/models"}
