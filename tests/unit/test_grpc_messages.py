"""The gRPC gateway's messages (frontend/grpc_messages.py, frontend/protos): the messages against
Triton's own descriptors, a ModelInferRequest as the HTTP /infer body and the answer back,
errors, model paths, compressed messages. Handlers, streams, reflection, the nginx block and the
config's checks: tests/unit/test_grpc_serving.py; through the real stack: tests/e2e/test_grpc.py."""

from __future__ import annotations

import struct

import grpc
import numpy as np
import orjson
import pytest
from tritonclient.grpc import model_config_pb2, service_pb2

from frontend import grpc_messages, protos
from frontend.errors import ApiError
from frontend.kserve import HEADER_LENGTH
from frontend.tensors import Tensor, encode_response, read_inputs, requested_outputs, split_body


def _triton(full_name: str):
    """Triton's descriptor of a message, from tritonclient's generated modules."""
    for module in (service_pb2, model_config_pb2):
        try:
            return module.DESCRIPTOR.pool.FindMessageTypeByName(full_name)
        except KeyError:
            continue
    raise KeyError(full_name)


def _messages(descriptor):
    yield descriptor
    for nested in descriptor.nested_types:
        if not nested.GetOptions().map_entry:
            yield from _messages(nested)


def test_every_message_field_has_tritons_number_type_and_label():
    """The wire is the field numbers: one that differs from Triton's is a value a Triton client
    reads in the wrong field, or not at all."""
    checked = 0
    kserve = protos.POOL.FindFileByName("kserve.proto")
    for top in kserve.message_types_by_name.values():
        for ours in _messages(top):
            theirs = _triton(ours.full_name)
            for field in ours.fields:
                other = theirs.fields_by_name[field.name]
                assert (field.number, field.type, field.is_repeated) == (
                    other.number, other.type, other.is_repeated), f"{ours.full_name}.{field.name}"
                if field.message_type is not None:
                    assert field.message_type.full_name == other.message_type.full_name
                checked += 1
    assert checked > 60
    ours = kserve.enum_types_by_name["DataType"]
    theirs = model_config_pb2.DESCRIPTOR.enum_types_by_name["DataType"]
    assert {v.name: v.number for v in ours.values} == {v.name: v.number for v in theirs.values}


def test_every_method_is_tritons_with_its_types():
    ours = protos.POOL.FindServiceByName(protos.KSERVE_SERVICE)
    theirs = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for method in ours.methods:
        other = theirs.methods_by_name[method.name]
        assert (method.input_type.full_name, method.output_type.full_name,
                method.client_streaming, method.server_streaming) == (
            other.input_type.full_name, other.output_type.full_name,
            other.client_streaming, other.server_streaming)
    assert {m.name for m in ours.methods} >= {"ModelInfer", "ModelStreamInfer", "ModelReady",
                                              "ServerReady", "ModelMetadata", "ModelConfig"}


def test_a_triton_request_reads_back_field_for_field():
    request = service_pb2.ModelInferRequest(model_name="m", model_version="v", id="7")
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=[2])
    tensor.parameters["p"].int64_param = 3
    request.parameters["priority"].uint64_param = 1
    request.outputs.add(name="embedding")
    request.raw_input_contents.append(b"\x01\x00\x00\x00a")
    ours = protos.ModelInferRequest.FromString(request.SerializeToString())
    assert (ours.model_name, ours.model_version, ours.id) == ("m", "v", "7")
    assert ours.inputs[0].parameters["p"].int64_param == 3
    assert ours.parameters["priority"].uint64_param == 1
    assert [o.name for o in ours.outputs] == ["embedding"]
    assert list(ours.raw_input_contents) == [b"\x01\x00\x00\x00a"]


def _bytes_tensor(*texts: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(t)) + t for t in texts)


def _http_inputs(header: bytes, tail: bytes) -> tuple[dict, list[Tensor]]:
    """What the HTTP route reads from the body `infer_body` makes (frontend.tensors)."""
    parsed, rest = split_body(header + tail, str(len(header)))
    return parsed, read_inputs(parsed, rest)


def test_raw_input_contents_go_as_binary_tensor_data():
    request = protos.ModelInferRequest(model_name="m", id="req-1")
    request.inputs.add(name="text", datatype="BYTES", shape=[2])
    request.raw_input_contents.append(_bytes_tensor(b"hello", "wörld".encode()))
    request.outputs.add(name="embedding")
    header, tail = grpc_messages.infer_body(request, None)
    parsed, inputs = _http_inputs(header, tail)
    assert inputs[0].data == [b"hello", "wörld".encode()]
    assert parsed["id"] == "req-1"
    assert parsed["outputs"] == [{"name": "embedding", "parameters": {"binary_data": True}}]
    assert parsed["parameters"] == {"binary_data_output": True}  # no deadline: no timeout


def test_bytes_contents_and_numeric_contents():
    request = protos.ModelInferRequest(model_name="m")
    text = request.inputs.add(name="text", datatype="BYTES", shape=[2])
    text.contents.bytes_contents.extend([b"a", b"bc"])
    number = request.inputs.add(name="n", datatype="INT64", shape=[3])
    number.contents.int64_contents.extend([1, 2, 3])
    header, tail = grpc_messages.infer_body(request, None)
    _, inputs = _http_inputs(header, tail)
    assert inputs[0].data == [b"a", b"bc"]
    assert inputs[1].data.tolist() == [1, 2, 3]


def test_an_outputs_own_parameters_go_to_the_route_to_judge():
    # tritonclient's class_count (the classification extension) and an output's shared-memory
    # region were dropped here, so the call answered the raw tensor where HTTP answers 422.
    request = protos.ModelInferRequest(model_name="m")
    request.inputs.add(name="text", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(_bytes_tensor(b"a"))
    output = request.outputs.add(name="embedding")
    output.parameters["classification"].int64_param = 2
    output.parameters["binary_data"].bool_param = False  # the data comes back binary anyway
    header, tail = grpc_messages.infer_body(request, None)
    parsed, _ = _http_inputs(header, tail)
    assert parsed["outputs"] == [{"name": "embedding",
                                  "parameters": {"classification": 2, "binary_data": True}}]
    with pytest.raises(ApiError, match="classification extension"):
        requested_outputs(parsed, ["embedding"])


def test_raw_contents_for_some_inputs_only_is_invalid():
    request = protos.ModelInferRequest(model_name="m")
    request.inputs.add(name="query", datatype="BYTES", shape=[1])
    request.inputs.add(name="text", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(_bytes_tensor(b"q"))
    with pytest.raises(grpc_messages.CallFailed) as caught:
        grpc_messages.infer_body(request, None)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "raw_input_contents holds 1 tensors for 2 inputs" in caught.value.message


@pytest.mark.parametrize("given, left_s, sent", [
    (None, 2.5, 2_500_000),  # the call's deadline becomes the request's timeout
    (1_000_000, 2.5, 1_000_000),  # a shorter timeout of the request's own stays
    (9_000_000, 2.5, 2_500_000),  # a longer one is cut to the deadline
    (9_000_000, None, 9_000_000),  # no deadline: the request's
    (0, 0.5, 500_000),  # 0: none given
    (-5, 2.5, -5),  # not a timeout: sent as it is, for the route to refuse
])
def test_the_calls_deadline_is_the_timeout(given, left_s, sent):
    request = protos.ModelInferRequest(model_name="m")
    if given is not None:
        request.parameters["timeout"].int64_param = given
    header, _ = grpc_messages.infer_body(request, left_s)
    assert orjson.loads(header)["parameters"]["timeout"] == sent


def test_the_http_answer_becomes_raw_output_contents():
    vectors = np.arange(6, dtype=np.float32).reshape(2, 3)
    body, length = encode_response({"model_name": "m", "model_version": "r1", "id": "x"},
                                   [(Tensor("embedding", "FP32", (2, 3), vectors), True)])
    reply = grpc_messages.infer_response({HEADER_LENGTH: str(length)}, body)
    assert (reply.model_name, reply.model_version, reply.id) == ("m", "r1", "x")
    assert reply.outputs[0].name == "embedding" and list(reply.outputs[0].shape) == [2, 3]
    got = np.frombuffer(reply.raw_output_contents[0], dtype="<f4").reshape(2, 3)
    np.testing.assert_array_equal(got, vectors)


@pytest.mark.parametrize("raw, status, text", [
    (b'{"error": "model \'x\' is not served"}', 404, "model 'x' is not served"),
    (b'{"error": {"message": "too many", "type": "too_large"}}', 413, "too many"),
    (b"<html>bad gateway</html>", 502, "<html>bad gateway</html>"),
    (b"", 503, "HTTP 503"),
])
def test_error_text(raw, status, text):
    assert grpc_messages.error_text(raw, status) == text


def test_status_codes_cover_the_errors_the_routes_answer():
    from frontend.errors import STATUS

    for status in set(STATUS.values()) - {500}:
        assert status in grpc_messages.STATUS_CODES, status


def test_a_model_path_keeps_the_slash_of_an_alias_and_quotes_the_rest():
    request = protos.ModelReadyRequest(name="org/my model", version="r 1")
    assert grpc_messages.model_path(request, "/ready") == \
        "/v2/models/org/my%20model/versions/r%201/ready"
    with pytest.raises(grpc_messages.CallFailed):
        grpc_messages.model_path(protos.ModelReadyRequest(), "/ready")


@pytest.mark.parametrize("name", ["..", "../../admin/models", "a/./b", "org/.."])
def test_a_model_name_with_a_dot_segment_reaches_no_other_route(name):
    with pytest.raises(grpc_messages.CallFailed, match="a '.' or '..' between slashes") as caught:
        grpc_messages.model_path(protos.ModelMetadataRequest(name=name))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_messages.model_path(protos.ModelMetadataRequest(name="v1.5/..x")) == \
        "/v2/models/v1.5/..x"


def test_a_name_longer_than_any_models_is_not_found():
    """Its path was too long for the frontend's HTTP parser: INVALID_ARGUMENT "malformed HTTP
    request (LineTooLong ...)" (an outside check)."""
    for request in (protos.ModelMetadataRequest(name="m" * 100_000),
                    protos.ModelMetadataRequest(name="m", version="1" * 300)):
        with pytest.raises(grpc_messages.CallFailed, match="at most 256 characters") as caught:
            grpc_messages.model_path(request)
        assert caught.value.code == grpc.StatusCode.NOT_FOUND
        assert len(caught.value.message) < 500
    assert grpc_messages.model_path(protos.ModelMetadataRequest(name="m" * 256)) == \
        "/v2/models/" + "m" * 256


def test_a_message_that_does_not_parse_is_undecodable_not_an_exception():
    parse = grpc_messages.parser(protos.ModelInferRequest)
    got = parse(b"\xff\xff\xff\xff garbage")
    assert isinstance(got, grpc_messages.Undecodable)
    assert got.message.startswith("the request is not a valid inference.ModelInferRequest")
    assert parse(protos.ModelInferRequest(model_name="m").SerializeToString()).model_name == "m"


def test_a_datatype_without_a_contents_field_goes_as_binary_for_the_route_to_judge():
    request = protos.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="text", datatype="FP16", shape=[1])
    tensor.contents.bytes_contents.append(b"\x00\x3c")
    header, tail = grpc_messages.infer_body(request, None)  # JSON could not hold the bytes
    assert orjson.loads(header)["inputs"][0]["parameters"] == {"binary_data_size": 2}
    assert tail == b"\x00\x3c"


def test_a_version_of_dots_is_refused():
    for version in (".", "..", "../..", "1/./2"):
        with pytest.raises(grpc_messages.CallFailed, match="between slashes"):
            grpc_messages.model_path(protos.ModelReadyRequest(name="m", version=version),
                                     "/ready")


def test_a_compressed_message_is_inflated_with_a_bound_not_whole():
    """The server runs without grpc's per-message decompression, which inflated a message whole
    before checking its size (1.9 MB of gzip took a frontend to 2.2 GB, before any API key was
    asked for: an outside check): the deserializer inflates gzip and deflate (zlib) itself, at
    most the body limit, and a message that is not compressed passes as it is."""
    import gzip
    import zlib

    from frontend import protos
    from frontend.grpc_messages import Undecodable, parser

    parse = parser(protos.message("inference.ModelInferRequest"), 1 << 20)
    message = protos.message("inference.ModelInferRequest")(model_name="m", id="x" * 100)
    raw = message.SerializeToString()
    for sent in (raw, gzip.compress(raw), zlib.compress(raw)):
        assert parse(sent) == message
    bomb = parse(gzip.compress(b"\0" * (50 << 20)))
    assert isinstance(bomb, Undecodable) and bomb.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert isinstance(parse(zlib.compress(b"\0" * (50 << 20))), Undecodable)
    broken = parse(gzip.compress(raw)[:-6])
    assert isinstance(broken, Undecodable) and broken.code == grpc.StatusCode.INVALID_ARGUMENT
