"""gRPC server reflection on the gRPC port: the services it serves and their .proto definitions,
so grpcurl, Postman and evans call it without the .proto files (`grpcurl -plaintext HOST:PORT
list`). Served as grpc.reflection.v1alpha.ServerReflection and, with the same messages (the
same fields), as grpc.reflection.v1's. It answers from the compiled descriptors alone, never
calling the frontend's HTTP routes: the API's shape, no model or key (auth.api_keys guards the
calls it describes, not the description)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from google.protobuf import descriptor_pb2

from frontend import protos
from frontend.grpc_messages import Undecodable, parser
from frontend.protos.descriptors import FILE_DESCRIPTOR_SET

REFLECTION = "grpc.reflection.v1alpha.ServerReflection"
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
# What `list` shows: the services whose definitions it can give (v1's is v1alpha's, renamed).
LISTED = (protos.KSERVE_SERVICE, protos.HEALTH_SERVICE, REFLECTION)
FILES = {f.name: f.SerializeToString()
         for f in descriptor_pb2.FileDescriptorSet.FromString(FILE_DESCRIPTOR_SET).file}

Request = protos.message("grpc.reflection.v1alpha.ServerReflectionRequest")
Response = protos.message("grpc.reflection.v1alpha.ServerReflectionResponse")
ServiceResponse = protos.message("grpc.reflection.v1alpha.ServiceResponse")


def answer(request) -> object:
    """The response to one reflection request."""
    response = Response(valid_host=request.host, original_request=request)
    kind = request.WhichOneof("message_request")
    if kind == "list_services":
        response.list_services_response.service.extend(ServiceResponse(name=n) for n in LISTED)
    elif kind == "file_by_filename":
        found = FILES.get(request.file_by_filename)
        if found is None:
            return _error(response, f"no file {request.file_by_filename!r}; this server's: "
                                    f"{', '.join(sorted(FILES))}")
        response.file_descriptor_response.file_descriptor_proto.append(found)
    elif kind == "file_containing_symbol":
        symbol = request.file_containing_symbol.removeprefix(".")
        if symbol == REFLECTION_V1:
            symbol = REFLECTION
        name = _file_of(symbol)
        if name is None:
            return _error(response, f"no symbol {symbol!r}")
        response.file_descriptor_response.file_descriptor_proto.append(FILES[name])
    elif kind == "all_extension_numbers_of_type":
        try:
            protos.POOL.FindMessageTypeByName(request.all_extension_numbers_of_type)
        except KeyError:
            return _error(response, f"no type {request.all_extension_numbers_of_type!r}")
        response.all_extension_numbers_response.base_type_name = \
            request.all_extension_numbers_of_type  # and no extensions: proto3 has none
    elif kind == "file_containing_extension":
        return _error(response, "this server's messages have no extensions")
    else:
        return _error(response, "an empty reflection request",
                      grpc.StatusCode.INVALID_ARGUMENT)
    return response


def _file_of(symbol: str) -> str | None:
    """The file defining `symbol`: a message, enum, service, or a service's method (which the
    pool does not look up by itself: grpcurl's `describe SERVICE.METHOD` asks for one)."""
    try:
        return protos.POOL.FindFileContainingSymbol(symbol).name
    except KeyError:
        pass
    service, _, method = symbol.rpartition(".")
    try:
        found = protos.POOL.FindServiceByName(service)
    except KeyError:
        return None
    # a method the service has, not any name under it (an outside check's "Service.Nope")
    return found.file.name if method in found.methods_by_name else None


def _error(response, message: str, code: grpc.StatusCode = grpc.StatusCode.NOT_FOUND):
    response.error_response.error_code = code.value[0]
    response.error_response.error_message = message
    return response


async def reflection_info(requests: AsyncIterator, context) -> AsyncIterator:
    async for request in requests:
        if isinstance(request, Undecodable):
            await context.abort(request.code, request.message)
        yield answer(request)


def handlers() -> list[grpc.GenericRpcHandler]:
    method = {"ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
        # a request names a symbol or a file: 1 MiB inflated is plenty
        reflection_info, request_deserializer=parser(Request, 1 << 20),
        response_serializer=Response.SerializeToString)}
    return [grpc.method_handlers_generic_handler(name, method)
            for name in (REFLECTION, REFLECTION_V1)]
