"""The gRPC tests' stack (server.grpc_port on, one API key) and their tritonclient helpers
(tests/e2e/test_grpc.py, tests/e2e/test_grpc_operations.py)."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import tiny_overrides
from tests.stack import Stack, free_port

KEY = "grpc-key-0123"
AUTH = {"authorization": f"Bearer {KEY}"}


def stack_fixture(name: str, **nginx):
    """A module's stack (`stack = grpcstack.stack_fixture(NAME)`): gRPC on a free port (its
    .grpc_port), nginx's body limit 64k (and `nginx`'s other keys), API key KEY; up once for
    the module."""

    @pytest.fixture(scope="module")
    def stack(tmp_path_factory, tiny_model):
        port = free_port()
        s = Stack(tmp_path_factory.mktemp(name) / "stack", tiny_overrides(
            tiny_model, server={"grpc_port": port}, auth={"api_keys": [KEY]},
            nginx={"client_max_body_size": "64k", **nginx}))
        s.grpc_port = port
        s.up()
        yield s
        s.down()

    return stack


@pytest.fixture
def client(stack):
    """tritonclient.grpc's client of the module's stack (`client = grpcstack.client`)."""
    with triton_grpc.InferenceServerClient(f"127.0.0.1:{stack.grpc_port}") as c:
        yield c


def texts(*values: bytes, name: str = "text") -> triton_grpc.InferInput:
    tensor = triton_grpc.InferInput(name, [len(values)], "BYTES")
    tensor.set_data_from_numpy(np.array(values, dtype=object))
    return tensor


def status_of(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value.status(), caught.value.message()


def model_stream(channel):
    """KServe v2's ModelStreamInfer on a raw grpc `channel`, as a stream of requests to a stream
    of answers (protos' messages)."""
    from frontend import protos

    return channel.stream_stream(
        "/inference.GRPCInferenceService/ModelStreamInfer",
        request_serializer=protos.ModelInferRequest.SerializeToString,
        response_deserializer=protos.ModelStreamInferResponse.FromString)
