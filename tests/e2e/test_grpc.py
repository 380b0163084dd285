"""KServe v2 over gRPC (server.grpc_port) through nginx and supervisord, with Triton's own
client (tritonclient.grpc) and a raw grpc channel: inference equal to HTTP's, each error as
its gRPC status (the frontend's and nginx's own), streams, health checking, request ids in
the logs, reflection. Operations under gRPC: tests/e2e/test_grpc_operations.py."""

from __future__ import annotations

import gzip
import json
import os
import queue
import signal
import socket
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http

from frontend import protos
from tests import grpcstack, h2stream
from tests.grpcstack import AUTH, status_of, texts
from tests.stack import Stack


# A body's wait for its client cut short (30 s by default), so the stream test below sees a
# stream outlast it
stack = grpcstack.stack_fixture("grpc", client_body_timeout_s=4)
client = grpcstack.client


def test_tritonclient_grpc_embeds_as_http_does(stack, client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tiny") and client.is_model_ready("test-org/tiny")
    assert not client.is_model_ready("no-such-model")  # Triton's answer: not ready, no error
    assert not client.is_model_ready("n" * 300)  # a name longer than any model's as well
    meta = client.get_model_metadata("tiny", headers=AUTH)
    assert meta.versions == ["tiny-r1"] and meta.outputs[0].shape == [-1, 32]
    config = client.get_model_config("tiny", headers=AUTH).config
    assert config.max_batch_size == 64 and config.output[0].dims == [32]
    assert client.get_server_metadata(headers=AUTH).name == "shmserve"

    words = (b"hello", "w\u00f6rld".encode(), b"shared memory")
    result = client.infer("tiny", [texts(*words)], headers=AUTH,
                          outputs=[triton_grpc.InferRequestedOutput("embedding")],
                          request_id="mine-1")
    got = result.as_numpy("embedding")
    response = result.get_response()
    assert (response.model_version, response.id) == ("tiny-r1", "mine-1")
    http = triton_http.InferenceServerClient(f"127.0.0.1:{stack.port}")
    tensor = triton_http.InferInput("text", [3], "BYTES")
    tensor.set_data_from_numpy(np.array(words, dtype=object))
    # (a copy: tritonclient.http adds its Inference-Header-Content-Length to the dict)
    want = http.infer("tiny", [tensor], headers=dict(AUTH)).as_numpy("embedding")
    assert got.shape == (3, 32) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    # a version pins the arm serving it, as over HTTP
    pinned = client.infer("tiny", [texts(b"a")], model_version="tiny-r1", headers=AUTH)
    assert pinned.get_response().model_version == "tiny-r1"


def test_status_names_the_grpc_address(stack):
    where = f"gRPC 127.0.0.1:{stack.grpc_port}"
    assert where in stack.cli("status").stdout.splitlines()[0]
    assert json.loads(stack.cli("status", "--json").stdout)["grpc_port"] == stack.grpc_port


def test_each_error_is_its_grpc_status(stack, client):
    unauth = status_of(lambda: client.infer("tiny", [texts(b"a")]))
    assert unauth[0] == "StatusCode.UNAUTHENTICATED" and "Bearer" in unauth[1]
    assert status_of(lambda: client.infer("nope", [texts(b"a")], headers=AUTH)) == (
        "StatusCode.NOT_FOUND", "model 'nope' is not served; see GET /v1/models")
    # a name longer than any model's, within the body limit (it was "malformed HTTP request
    # (LineTooLong ...)")
    code, message = status_of(lambda: client.infer("n" * 20_000, [texts(b"a")], headers=AUTH))
    assert code == "StatusCode.NOT_FOUND" and "at most 256 characters" in message, message
    code, message = status_of(lambda: client.infer("tiny", [texts(*[b"a"] * 65)], headers=AUTH))
    assert code == "StatusCode.INVALID_ARGUMENT" and "limits.max_texts_per_request" in message
    code, message = status_of(lambda: client.infer("tiny", [texts(b"\xff")], headers=AUTH))
    assert (code, message) == ("StatusCode.INVALID_ARGUMENT", "'text[0]' is not valid UTF-8")
    code, message = status_of(lambda: client.infer("tiny", [texts(b"a", name="txt")],
                                                   headers=AUTH))
    assert code == "StatusCode.INVALID_ARGUMENT" and "['text']" in message
    # nginx's own: a body past nginx.client_max_body_size (64k)
    code, message = status_of(lambda: client.infer("tiny", [texts(b"x" * 100_000)],
                                                   headers=AUTH))
    assert code == "StatusCode.RESOURCE_EXHAUSTED"
    assert message == "request body larger than nginx.client_max_body_size (64k)"
    assert status_of(lambda: client.get_system_shared_memory_status(headers=AUTH))[0] == \
        "StatusCode.UNIMPLEMENTED"
    # Triton's repository index, as HTTP's; load and unload refused with what to do instead
    index = client.get_model_repository_index(headers=AUTH, as_json=True)["models"]
    assert index == [{"name": "tiny", "version": "tiny-r1", "state": "READY"}]
    code, message = status_of(lambda: client.unload_model("tiny", headers=AUTH))
    assert code == "StatusCode.INVALID_ARGUMENT" and "shmserve apply" in message, message
    assert status_of(lambda: client.load_model("nope", headers=AUTH))[0] == \
        "StatusCode.NOT_FOUND"
    # Triton's statistics, as HTTP's (no inference between the two), by version; a version
    # without its model's name is refused
    client.infer("tiny", [texts(b"counted")], headers=AUTH)
    http = triton_http.InferenceServerClient(stack.url.removeprefix("http://"))
    [by_http] = http.get_inference_statistics("tiny", headers=AUTH)["model_stats"]
    [stat] = client.get_inference_statistics("tiny", "tiny-r1", headers=AUTH,
                                             as_json=True)["model_stats"]
    assert stat["name"] == "tiny" and stat["version"] == "tiny-r1" and stat["batch_stats"]
    assert int(stat["inference_count"]) == by_http["inference_count"] > 0
    assert int(stat["inference_stats"]["success"]["ns"]) == \
        by_http["inference_stats"]["success"]["ns"]
    assert [s.name for s in client.get_inference_statistics(headers=AUTH).model_stats] == \
        ["tiny"]
    assert status_of(lambda: client.get_inference_statistics("", "tiny-r1", headers=AUTH)) == \
        ("StatusCode.INVALID_ARGUMENT", "a version needs its model's name")
    assert status_of(lambda: client.get_inference_statistics("tiny", "9", headers=AUTH))[0] == \
        "StatusCode.NOT_FOUND"
    counted = calls_by_status(stack)
    for key in (("ModelInfer", "UNAUTHENTICATED"), ("ModelInfer", "NOT_FOUND"),
                ("ModelInfer", "INVALID_ARGUMENT")):
        assert counted.get(key, 0) >= 1, (key, counted)
    assert calls_by_status(stack).get(("other", "UNIMPLEMENTED"), 0) >= 1  # the repository
    # a name that a URL path would resolve reaches no other route (GET /admin/models here)
    assert status_of(lambda: client.get_model_metadata("../../admin/models", headers=AUTH))[0] \
        == "StatusCode.INVALID_ARGUMENT"


def calls_by_status(stack: Stack) -> dict[tuple[str, str], float]:
    """shmserve_grpc_calls_total from GET /metrics, by (method, code)."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, raw = stack.get("/metrics")
    assert status == 200
    family = next((f for f in text_string_to_metric_families(raw.decode())
                   if f.name == "shmserve_grpc_calls"), None)  # (none before the first call)
    return {(s.labels["method"], s.labels["code"]): s.value for s in family.samples
            if s.name.endswith("_total")} if family is not None else {}


def test_a_stream_answers_every_request_each_with_its_id(stack, client):
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)),
                        headers={**AUTH, "x-request-id": "stream-e2e"})
    try:
        for i in range(6):
            body = b"\xff" if i == 2 else b"word " * (i + 1)
            client.async_stream_infer("tiny", [texts(body)], request_id=str(i))
        got = [answers.get(timeout=30) for _ in range(6)]
    finally:
        client.stop_stream()
    ids = sorted(r.get_response().id for r, e in got if e is None)
    errors = [str(e) for r, e in got if e is not None]
    assert ids == ["0", "1", "3", "4", "5"]
    assert len(errors) == 1 and "'text[0]' is not valid UTF-8" in errors[0]
    # each request of the stream has its own request id in the frontends' access lines, the
    # stream's and its place (all had the stream's one: an outside check)
    want = {f"stream-e2e:{n}" for n in range(1, 7)}
    seen: set[str] = set()

    def logged() -> bool:
        seen.update(line.get("request_id") for program in ("frontend-0", "frontend-1")
                    for line in stack.log_lines(program) if line.get("message") == "request"
                    and str(line.get("request_id", "")).startswith("stream-e2e"))
        return seen >= want
    stack.wait_until(logged, 10, "an access line for each request of the stream")
    assert seen == want


def test_a_stream_cut_short_is_counted_cancelled_not_ok(stack):
    """A stream its client cancels, its first request answered and its second in flight (the
    workers frozen), counts in shmserve_grpc_calls_total as CANCELLED, not OK. (One nginx cuts,
    nginx.grpc_stream_idle_timeout_s, reaches the frontend as the same RST_STREAM: CANCELLED
    too, seen by hand with a 2 s timeout. A cancel that reaches a stream idle between requests
    races grpcio's end of the request iterator: in a loop of 300 such cancels on grpcio 1.67,
    3 ended the iterator before the cancellation reached the handler, which returned and
    counted OK, as a client's half-close does; CI's fresh clone met it once when this test
    cancelled an idle stream.)"""
    import threading

    from tests.e2e.test_reliability import inflight

    before = calls_by_status(stack)

    def infer(id_: str) -> protos.ModelInferRequest:
        request = protos.ModelInferRequest(model_name="tiny", id=id_)
        request.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents \
            .append(b"a stream cut short")
        return request

    answered, gate = threading.Event(), threading.Event()

    def requests():
        yield infer("cut-1")
        answered.wait(30)
        yield infer("cut-2")
        gate.wait(30)  # the stream stays open until the client cancels it

    workers = [p["pid"] for p in stack.processes() if p["group"] == "workers"]
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stream = grpcstack.model_stream(channel)
        answers = stream(requests(), metadata=list(AUTH.items()))
        assert next(answers).infer_response.id == "cut-1"
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        try:
            answered.set()
            stack.wait_until(lambda: inflight(stack) == 1, 30, "cut-2 in flight")
            answers.cancel()
        finally:
            gate.set()
            for pid in workers:
                os.kill(pid, signal.SIGCONT)

    def grew(code: str) -> float:
        key = ("ModelStreamInfer", code)
        return calls_by_status(stack).get(key, 0.0) - before.get(key, 0.0)
    stack.wait_until(lambda: grew("CANCELLED") == 1, 10, "the cut stream counted CANCELLED")
    assert grew("OK") == 0


def test_a_stream_stays_open_while_idle_past_the_body_timeout(stack, client):
    """tritonclient's start_stream is meant to be kept open between requests: nginx cut a
    stream idle for client_body_timeout_s (30 s), INTERNAL "Received RST_STREAM" to the
    client. A stream has nginx.grpc_stream_idle_timeout_s (an hour) instead; here the stack's
    body timeout is 4 s (a unary call's body under the suite's load stays well within it) and
    the stream idles 5."""
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)),
                        headers=AUTH)
    try:
        client.async_stream_infer("tiny", [texts(b"before")], request_id="before")
        assert answers.get(timeout=30)[1] is None
        time.sleep(5)
        client.async_stream_infer("tiny", [texts(b"after")], request_id="after")
        result, error = answers.get(timeout=30)
        assert error is None, error
        assert result.get_response().id == "after"
    finally:
        client.stop_stream()


def test_health_checking_and_the_request_id_in_every_log(stack):
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=protos.HealthCheckRequest.SerializeToString,
            response_deserializer=protos.HealthCheckResponse.FromString)
        for service in ("", "inference.GRPCInferenceService"):
            assert check(protos.HealthCheckRequest(service=service)).status == \
                protos.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as caught:
            check(protos.HealthCheckRequest(service="other"))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND

        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=protos.ModelInferRequest.SerializeToString,
            response_deserializer=protos.ModelInferResponse.FromString)
        request = protos.ModelInferRequest(model_name="tiny")
        tensor = request.inputs.add(name="text", datatype="BYTES", shape=[1])
        tensor.contents.bytes_contents.append(b"hello")  # contents, not raw_input_contents
        reply, call = infer.with_call(request, timeout=30, metadata=[
            *AUTH.items(), ("x-request-id", "grpc-trace-42")])
    metadata = dict(call.initial_metadata())
    assert metadata["x-request-id"] == "grpc-trace-42"
    assert float(metadata["x-inference-time"]) >= 0 and metadata["x-model-revision"] == "tiny-r1"
    assert np.frombuffer(reply.raw_output_contents[0], "<f4").shape == (32,)

    def lines(name: str) -> list[dict]:
        path = stack.run_dir / "logs" / name
        return [json.loads(line) for line in path.read_text().splitlines()
                if line.startswith("{") and "grpc-trace-42" in line]

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        nginx = lines("nginx.log")
        frontends = lines("frontend-0.log") + lines("frontend-1.log")
        if nginx and frontends:
            break
        time.sleep(0.2)
    assert [(n["uri"], n["grpc_status"]) for n in nginx] == [
        ("/inference.GRPCInferenceService/ModelInfer", "0")]
    assert [(f["route"], f["status"], f["timeout_by"]) for f in frontends] == [
        ("/v2/models/{model}/infer", 200, "parameters.timeout")], frontends
    assert 25 < frontends[0]["timeout_s"] <= 31  # the call's deadline (grpc rounds it up)


def test_raw_calls_bad_bytes_a_streams_error_and_the_http_headers_as_metadata(stack):
    """A message that does not parse is INVALID_ARGUMENT (grpc's default was UNKNOWN, with a
    traceback); a stream's error answer names its request; X-Request-Timeout as metadata is the
    HTTP header's deadline."""
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as caught:
            raw(b"\xff\xff\xff\xff not a message", metadata=list(AUTH.items()))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid inference.ModelInferRequest" in caught.value.details()

        stream = grpcstack.model_stream(channel)
        bad = protos.ModelInferRequest(model_name="no-such-model", id="bad-7")
        bad.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
            b"a")
        (answer,) = list(stream(iter([bad]), metadata=list(AUTH.items())))
        assert "not served" in answer.error_message
        assert (answer.infer_response.id, answer.infer_response.model_name) == (
            "bad-7", "no-such-model")

        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=protos.ModelInferRequest.SerializeToString,
            response_deserializer=protos.ModelInferResponse.FromString)
        request = protos.ModelInferRequest(model_name="tiny")
        request.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents \
            .append(b"a")
        with pytest.raises(grpc.RpcError) as caught:
            infer(request, metadata=[*AUTH.items(), ("x-request-timeout", "-1")])
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "X-Request-Timeout" in caught.value.details()


def h2_call(port: int, headers: list[tuple[str, str]], body: bytes) -> dict[str, str]:
    """One raw HTTP/2 call to ModelInfer (what grpcio's client will not send: an encoding it
    lacks, a grpc-timeout not as gRPC writes it): the answer's gRPC headers and trailers."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        got, _ = h2stream.exchange(sock, [
            (":method", "POST"), (":scheme", "http"), (":authority", "127.0.0.1"),
            (":path", "/inference.GRPCInferenceService/ModelInfer"),
            ("content-type", "application/grpc"), ("te", "trailers"), *AUTH.items(),
            *headers], body)
    assert "grpc-status" in got, got  # (a reset stream, or nginx's close, has none)
    return got


def test_calls_grpc_would_hang_or_reset_are_answered_at_once(stack, client):
    """An outside check: a unary call with no message hung until nginx's read timeout (120 s:
    grpc.aio's unary handler never answers it); an unknown grpc-encoding or a malformed
    grpc-timeout was reset by grpc, which nginx took for a failed frontend (UNAVAILABLE, "no
    frontend answered", which clients retry); an output's class_count was dropped."""
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        none = channel.stream_unary("/inference.GRPCInferenceService/ModelInfer")
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            none(iter(()), metadata=list(AUTH.items()), timeout=60)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        assert "without a request message" in caught.value.details()
        assert time.monotonic() - started < 30  # not the 60 s deadline, nor nginx's 120 s
    request = protos.ModelInferRequest(model_name="tiny")
    request.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents \
        .append(b"a")
    message = request.SerializeToString()
    frame = bytes([0]) + len(message).to_bytes(4, "big") + message
    assert h2_call(stack.grpc_port, [], frame)["grpc-status"] == "0"
    snappy = h2_call(stack.grpc_port, [("grpc-encoding", "snappy")], bytes([1]) + frame[1:])
    assert snappy["grpc-status"] == "12", snappy  # UNIMPLEMENTED, as gRPC's spec says
    assert "gzip" in snappy["grpc-accept-encoding"]
    bad = h2_call(stack.grpc_port, [("grpc-timeout", "abc")], frame)
    assert bad["grpc-status"] == "3", bad  # INVALID_ARGUMENT
    assert h2_call(stack.grpc_port, [("grpc-timeout", "10S")], frame)["grpc-status"] == "0"
    # A gzip bomb: grpc inflated it whole before its size check (2.2 GB for 1.9 MB of gzip,
    # before the key was asked for); now at most the body limit (64k here) is inflated.
    bomb = gzip.compress(b"\0" * (16 << 20))
    over = h2_call(stack.grpc_port, [("grpc-encoding", "gzip")],
                   bytes([1]) + len(bomb).to_bytes(4, "big") + bomb)
    assert over["grpc-status"] == "8", over  # RESOURCE_EXHAUSTED
    assert "inflates to more than 65536 bytes" in over["grpc-message"], over
    plain = client.infer("tiny", [texts(b"a", b"b c")], headers=AUTH).as_numpy("embedding")
    for algorithm in ("gzip", "deflate"):
        np.testing.assert_array_equal(client.infer(
            "tiny", [texts(b"a", b"b c")], headers=AUTH,
            compression_algorithm=algorithm).as_numpy("embedding"), plain)
    assert status_of(lambda: client.infer(
        "tiny", [texts(b"a")], headers=AUTH,
        outputs=[triton_grpc.InferRequestedOutput("embedding", class_count=2)]))[0] == \
        "StatusCode.INVALID_ARGUMENT"


def test_a_client_without_the_protos_calls_through_reflection(stack):
    """As grpcurl does: list the services over reflection (v1), fetch the KServe service's file,
    build its messages from it alone (a pool of the test's own), call ServerReady with them."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    from frontend import grpc_reflection as reflection

    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        info = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection.Request.SerializeToString,
            response_deserializer=reflection.Response.FromString)
        listed, described = list(info(iter([
            reflection.Request(list_services="*"),
            reflection.Request(file_containing_symbol="inference.GRPCInferenceService")])))
        assert "inference.GRPCInferenceService" in [
            s.name for s in listed.list_services_response.service]
        pool = descriptor_pool.DescriptorPool()
        for raw in described.file_descriptor_response.file_descriptor_proto:
            pool.Add(descriptor_pb2.FileDescriptorProto.FromString(raw))
        method = pool.FindServiceByName("inference.GRPCInferenceService").methods_by_name[
            "ServerReady"]
        request_type = message_factory.GetMessageClass(method.input_type)
        reply_type = message_factory.GetMessageClass(method.output_type)
        ready = channel.unary_unary("/inference.GRPCInferenceService/ServerReady",
                                    request_serializer=request_type.SerializeToString,
                                    response_deserializer=reply_type.FromString)
        assert ready(request_type()).ready is True
