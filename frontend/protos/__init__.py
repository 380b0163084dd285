"""The gRPC messages frontend/grpc_api.py serves (KServe v2's and gRPC health checking's), built
from the compiled descriptors in a descriptor pool of their own: tritonclient.grpc registers the
same names (inference.ModelInferRequest, ...) in protobuf's default pool, and two definitions of
one name in a pool are an error at import. Attribute access gives a message class by its short
name (``protos.ModelInferRequest``; nested ones as
``protos.ModelInferRequest.InferInputTensor``)."""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from frontend.protos.descriptors import FILE_DESCRIPTOR_SET

POOL = descriptor_pool.DescriptorPool()
for _file in descriptor_pb2.FileDescriptorSet.FromString(FILE_DESCRIPTOR_SET).file:
    POOL.Add(_file)

KSERVE_SERVICE = "inference.GRPCInferenceService"
HEALTH_SERVICE = "grpc.health.v1.Health"
_PACKAGES = {"HealthCheckRequest": "grpc.health.v1", "HealthCheckResponse": "grpc.health.v1"}


def message(full_name: str) -> type:
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(full_name))


def __getattr__(name: str) -> type:
    try:
        return message(f"{_PACKAGES.get(name, 'inference')}.{name}")
    except KeyError:
        raise AttributeError(name) from None
