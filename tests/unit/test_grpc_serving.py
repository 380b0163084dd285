"""The gRPC gateway's serving side without a stack: its methods' handlers and streams
(frontend/grpc_api.py), server reflection, the nginx block (shmserve/grpc_nginx.py) and the
config's and `up`'s checks of server.grpc_port. The messages: tests/unit/test_grpc_messages.py;
through the real stack: tests/e2e/test_grpc.py and test_grpc_operations.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from aiohttp import web

from frontend import grpc_api, grpc_messages, protos
from shmserve import grpc_nginx, render, tls
from shmserve.config import ConfigError
from tests.unit.test_render import make_config


def test_a_unary_call_without_a_request_message_is_invalid_not_hung():
    # grpc.aio's unary handler never answered a call half-closed without a message (nginx's
    # grpc_read_timeout, 120 s, then DEADLINE_EXCEEDED): unary methods read their one message.
    calls = []

    async def behavior(request, context):
        calls.append(request)
        return "answer"

    class Context:
        def __init__(self, messages):
            self._messages = list(messages)

        async def read(self):
            return self._messages.pop(0) if self._messages else grpc.aio.EOF

    method = protos.POOL.FindServiceByName(protos.KSERVE_SERVICE).methods_by_name["ModelInfer"]
    handler = grpc_api._handler(method, behavior, -1)
    assert handler.request_streaming and not handler.response_streaming
    request = protos.ModelInferRequest(model_name="m")
    assert asyncio.run(handler.stream_unary(None, Context([request]))) == "answer"
    assert asyncio.run(handler.stream_unary(None, Context([]))) == "answer"
    assert calls[0] is request
    assert isinstance(calls[1], grpc_messages.Undecodable)
    assert "without a request message" in calls[1].message


def test_no_grpc_block_without_a_port(tmp_path):
    cfg = make_config(tmp_path)
    assert grpc_nginx.block(cfg, "nginx", {}, render.fill) == "    # no gRPC: server.grpc_port is 0"


def test_the_grpc_server_listens_http2_on_its_port(tmp_path):
    cfg = make_config(tmp_path, server={"grpc_port": 9001})
    text = render.render_nginx(cfg)
    assert "listen 127.0.0.1:9001" in text
    if tls.nginx_version(render.nginx_binary(cfg)) >= tls.HTTP2_DIRECTIVE:
        assert "http2 on;" in text
    else:
        assert "listen 127.0.0.1:9001 http2 " in text
    assert f'server "unix:{tmp_path}/sockets/frontend-0.grpc.sock"' in text
    assert "grpc_pass grpc://frontends_grpc;" in text
    assert "error_page 502 = /_shmserve_grpc_error/502;" in text
    assert "add_header grpc-status 14 always;" in text
    # a grpc-encoding grpc cannot decode, or a malformed grpc-timeout, is nginx's answer: grpc
    # reset such a call, which nginx took for a failed frontend (UNAVAILABLE, retried)
    assert "if ($shmserve_grpc_refused_encoding) { return 415; }" in text
    assert "if ($shmserve_grpc_refused_timeout) { return 400; }" in text
    assert "add_header grpc-status 12 always;" in text


def test_a_stream_has_its_own_idle_timeouts(tmp_path):
    """ModelStreamInfer's location waits nginx.grpc_stream_idle_timeout_s for the client's next
    request and the next answer; a unary call keeps client_body_timeout_s and
    proxy_read_timeout_s (e2e: test_grpc's idle stream)."""
    import re

    cfg = make_config(tmp_path, server={"grpc_port": 9001},
                      nginx={"grpc_stream_idle_timeout_s": 900})
    text = render.render_nginx(cfg)
    stream = re.search(r"location = /inference\.GRPCInferenceService/ModelStreamInfer \{(.*?)\n"
                       r"        \}", text, re.S)
    assert stream, text
    assert "client_body_timeout 900s;" in stream.group(1)
    assert "grpc_read_timeout 900s;" in stream.group(1)
    assert "grpc_pass grpc://frontends_grpc;" in stream.group(1)
    assert "if ($shmserve_grpc_refused_timeout) { return 400; }" in stream.group(1)
    assert "grpc_read_timeout 120s;" in text and "client_body_timeout 30s;" in text
    with pytest.raises(ConfigError, match="nginx.grpc_stream_idle_timeout_s"):
        make_config(tmp_path, nginx={"grpc_stream_idle_timeout_s": 0})


def test_grpc_port_must_differ_from_the_http_port(tmp_path):
    with pytest.raises(ConfigError, match="server.grpc_port: 8080 is server.port too"):
        make_config(tmp_path, server={"grpc_port": 8080, "port": 8080})
    with pytest.raises(ConfigError, match="server.grpc_port"):
        make_config(tmp_path, server={"grpc_port": 70000})


def test_reflection_lists_the_services_and_gives_their_files():
    from google.protobuf import descriptor_pb2

    from frontend import grpc_reflection as reflection

    listed = reflection.answer(reflection.Request(list_services="*"))
    names = [s.name for s in listed.list_services_response.service]
    assert names == ["inference.GRPCInferenceService", "grpc.health.v1.Health",
                     "grpc.reflection.v1alpha.ServerReflection"]
    for symbol, file in (("inference.GRPCInferenceService", "kserve.proto"),
                         (".inference.ModelInferRequest", "kserve.proto"),
                         ("inference.GRPCInferenceService.ModelInfer", "kserve.proto"),
                         ("grpc.health.v1.Health", "health.proto"),
                         ("grpc.reflection.v1.ServerReflection", "reflection.proto")):
        got = reflection.answer(reflection.Request(file_containing_symbol=symbol))
        (raw,) = got.file_descriptor_response.file_descriptor_proto
        assert descriptor_pb2.FileDescriptorProto.FromString(raw).name == file, symbol
    by_name = reflection.answer(reflection.Request(file_by_filename="health.proto"))
    assert by_name.file_descriptor_response.file_descriptor_proto[0] == \
        reflection.FILES["health.proto"]
    for request in (reflection.Request(file_containing_symbol="no.Such"),
                    reflection.Request(
                        file_containing_symbol="inference.GRPCInferenceService.Nope"),
                    reflection.Request(file_containing_symbol="grpc.health.v1.Health.Nope"),
                    reflection.Request(file_by_filename="other.proto"),
                    reflection.Request(all_extension_numbers_of_type="no.Such")):
        assert reflection.answer(request).error_response.error_code == \
            grpc.StatusCode.NOT_FOUND.value[0]
    assert reflection.answer(reflection.Request()).error_response.error_code == \
        grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert reflection.answer(reflection.Request(
        all_extension_numbers_of_type="inference.ModelInferRequest")
    ).all_extension_numbers_response.base_type_name == "inference.ModelInferRequest"


def test_up_refuses_a_grpc_port_another_process_holds(tmp_path):
    import os
    import socket

    from shmserve.prechecks import CliError, check_port

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cfg = make_config(tmp_path, server={"grpc_port": port})
        with pytest.raises(CliError, match=f"127.0.0.1:{port} is in use by another process "
                                           rf"\(pid {os.getpid()}, [^)]*\); "
                                           r"choose another server.grpc_port \(SHMSERVE__SERVER"
                                           "__GRPC_PORT\\)"):
            check_port(cfg)
        check_port(cfg, ("server.port",))  # the HTTP port alone is free


def test_the_grpc_probes_are_never_rate_limited(tmp_path):
    cfg = make_config(tmp_path, server={"grpc_port": 9001},
                      nginx={"rate_limit_per_s": 5, "rate_limit_burst": 2,
                             "max_requests_per_client": 3})
    text = render.render_nginx(cfg)
    grpc_part = text[text.index("upstream frontends_grpc"):]
    root = grpc_part[grpc_part.index("location / {"):]
    probes = grpc_part[grpc_part.index("location ~ ^/(grpc\\.health"):]
    assert "limit_req zone=" in root[:root.index("}")]
    assert "limit_conn shmserve_inflight_ip 3;" in root[:root.index("}")]
    # past the requests in flight: RESOURCE_EXHAUSTED, saying which limit, counted as a 429
    refusal = grpc_part[grpc_part.index("location = /_shmserve_grpc_error/429/460 {"):]
    refusal = refusal[:refusal.index("}")]
    assert "grpc-status 8" in refusal and "max_requests_per_client" in refusal, refusal
    assert "ServerLive|ServerReady|ModelReady" in probes[:probes.index("{")]
    # the probes' location counts what only nginx reads as a probe; the key is empty for the
    # probes as written (tests/unit/test_nginx_limits.py sends both)
    exempt = text[text.index("map $request_uri $shmserve_rate_limit_key"):]
    assert "ServerLive|ServerReady|ModelReady" in exempt[:exempt.index("}")]


async def test_a_stream_cancelled_while_it_reads_leaves_no_unretrieved_read(tmp_path):
    """A client gone mid-stream: grpc ends the pending read later (StopAsyncIteration), which
    asyncio logged at ERROR, 'Task exception was never retrieved' (an outside check)."""
    import gc

    gateway = grpc_api.Gateway(make_config(tmp_path), web.Application())
    release = asyncio.Event()

    async def requests():
        await release.wait()
        return
        yield

    seen: list[str] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: seen.append(context["message"]))
    try:
        call = asyncio.create_task(gateway.model_stream_infer(requests(), None))
        await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        release.set()
        await asyncio.sleep(0.05)
        gc.collect()
        await asyncio.sleep(0)
        assert not [message for message in seen if "never retrieved" in message]
    finally:
        loop.set_exception_handler(None)


def test_each_request_of_a_stream_has_its_own_request_id():
    """A stream's requests had the stream's id (nginx's) on every access and batch line: one
    could not be told from another (an outside check: 5 access lines with one id). Each is
    the stream's id and its place in the stream; other metadata is the stream's."""
    class Context:
        def invocation_metadata(self):
            return (("x-request-id", "3c6fb21b"), ("authorization", "Bearer k"))

    assert grpc_api._StreamCall(Context(), 3).invocation_metadata() == (
        ("x-request-id", "3c6fb21b:3"), ("authorization", "Bearer k"))
    assert dict(grpc_api._StreamCall(Context(), 12).invocation_metadata())["x-request-id"] == \
        "3c6fb21b:12"
    from frontend.app import _REQUEST_ID
    assert _REQUEST_ID.match("3c6fb21b:12")  # the frontend keeps it, not a made-up one

    class Longest:
        def invocation_metadata(self):
            return (("x-request-id", "a" * 127),)

    # one that would pass the frontend's limit stays the stream's id
    assert grpc_api._StreamCall(Longest(), 5).invocation_metadata() == (
        ("x-request-id", "a" * 127),)


async def test_a_streams_requests_go_with_their_numbers(tmp_path, monkeypatch):
    """model_stream_infer numbers the requests it reads, 1, 2, 3, in the order read."""
    gateway = grpc_api.Gateway(make_config(tmp_path), web.Application())
    seen: list[str] = []

    async def infer(request, call):
        seen.append(dict(call.invocation_metadata())["x-request-id"])
        return protos.ModelInferResponse(id=request.id)

    monkeypatch.setattr(gateway, "model_infer", infer)

    class Context:
        written: list = []

        def invocation_metadata(self):
            return (("x-request-id", "s1"),)

        async def write(self, reply):
            self.written.append(reply.infer_response.id)

    async def requests():
        for i in range(3):
            yield protos.ModelInferRequest(model_name="m", id=f"r{i}")

    context = Context()
    await gateway.model_stream_infer(requests(), context)
    assert sorted(seen) == ["s1:1", "s1:2", "s1:3"]
    assert sorted(context.written) == ["r0", "r1", "r2"]
