"""Server reflection that clients can use: grpc.reflection.v1 and v1alpha, with error details.

grpcio-reflection serves only `grpc.reflection.v1alpha`; current clients (grpcurl, buf curl,
Postman) ask for `grpc.reflection.v1` first. The two protocols have the same messages under
two package names (same fields, same numbers), so one servicer answers both: v1 calls are
parsed and written with the v1alpha classes, byte for byte what v1 would produce.

Every error a kvhandoff service returns carries a `google.rpc.Status` with an `ErrorInfo`
(common/errors.py). A client decodes those details only if it knows their descriptors, and
clients know only the files reflection sent them (those of the service they call). So every
file answer also carries google/rpc/status.proto and google/rpc/error_details.proto (and what
they import); a reflection answer may hold more files than were asked for.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.rpc import error_details_pb2, status_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha

V1_SERVICE = "grpc.reflection.v1.ServerReflection"
ERROR_DETAIL_FILES = (status_pb2.DESCRIPTOR.name, error_details_pb2.DESCRIPTOR.name)


def _with_dependencies(names: tuple[str, ...]) -> list[bytes]:
    """Serialized FileDescriptorProtos of the files and everything they import, each file
    after its imports."""
    pool = descriptor_pool.Default()
    ordered: list = []

    def visit(file) -> None:
        if file in ordered:
            return
        for dependency in file.dependencies:
            visit(dependency)
        ordered.append(file)

    for name in names:
        visit(pool.FindFileByName(name))
    out = []
    for file in ordered:
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        out.append(proto.SerializeToString())
    return out


class ReflectionServicer(reflection.aio.ReflectionServicer):
    """The grpc.aio reflection servicer, adding the error-detail files to every file answer."""

    def __init__(self, service_names: list[str]) -> None:
        super().__init__(service_names)
        self._extra_files = _with_dependencies(ERROR_DETAIL_FILES)

    async def ServerReflectionInfo(self, request_iterator, context):
        async for response in super().ServerReflectionInfo(request_iterator, context):
            if response.HasField("file_descriptor_response"):
                files = response.file_descriptor_response.file_descriptor_proto
                files.extend(f for f in self._extra_files if f not in files)
            yield response


def enable_reflection(service_names: list[str], server: grpc.aio.Server) -> None:
    """Serves reflection for service_names (plus v1alpha reflection itself) under both v1alpha
    and v1 on a grpc.aio server. The v1 service is not listed: this process holds no v1
    descriptor to describe it with, and a listed service that cannot be described breaks
    clients that describe everything (`grpcurl describe`)."""
    servicer = ReflectionServicer([*service_names, reflection.SERVICE_NAME])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.method_handlers_generic_handler(V1_SERVICE, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=v1alpha.ServerReflectionRequest.FromString,
            response_serializer=v1alpha.ServerReflectionResponse.SerializeToString)})
    server.add_generic_rpc_handlers((v1,))
