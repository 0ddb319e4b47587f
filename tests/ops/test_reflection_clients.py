"""Reflection that today's clients use: `buf curl` speaks grpc.reflection.v1 to both services
and receives the descriptors of the error details (google.rpc.Status, ErrorInfo).

buf curl prints an error detail's `debug` (decoded) form only for message types compiled into
buf itself, which google.rpc.ErrorInfo is not in buf 1.x, so its output keeps `value` in base64
whatever the server sends; the tests check what the server controls: v1 answers, and every file
answer carries google/rpc/error_details.proto, which clients that resolve Any through
reflection (grpcurl, Postman) need to show the reason.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from google.rpc import error_details_pb2
from grpc_reflection.v1alpha import reflection_pb2

pytestmark = pytest.mark.slow

BAD_PROMPT = json.dumps({"token_ids": {"ids": [99999]}})


def buf_curl(tmp_path: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    buf = Path(sys.executable).parent / "buf"
    if not buf.exists():
        pytest.fail(f"no buf next to {sys.executable}; install the test extras (buf-bin)")
    return subprocess.run([str(buf), "curl", "--protocol", "grpc", "--http2-prior-knowledge",
                           "--reflect-protocol", "grpc-v1", *args, url], capture_output=True,
                          text=True, timeout=60, check=False,
                          env={"BUF_CACHE_DIR": str(tmp_path), "HOME": str(tmp_path),
                               "PATH": ""})


def test_buf_curl_calls_decode_through_reflection_v1(ops_cluster, tmp_path):
    result = buf_curl(tmp_path, f"http://{ops_cluster.address}/kvhandoff.v1.GenerationService/"
                      "Generate", "-v", "-d", BAD_PROMPT)
    out = result.stdout + result.stderr
    assert "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo" in out, out
    assert "outside the vocabulary" in out, out  # the schema resolved and the call was made
    for name in ("google/rpc/status.proto", "google/rpc/error_details.proto"):
        assert f'resolved file "{name}"' in out, out
    plain = buf_curl(tmp_path, f"http://{ops_cluster.address}/kvhandoff.v1.GenerationService/"
                     "Generate", "-d", BAD_PROMPT)
    error = json.loads(plain.stderr)
    assert error["code"] == "invalid_argument"
    (detail,) = error["details"]
    assert detail["type"] == "google.rpc.ErrorInfo"
    info = error_details_pb2.ErrorInfo.FromString(base64.b64decode(detail["value"] + "=="))
    assert info.reason == "TOKEN_OUT_OF_VOCAB" and info.domain == "kvhandoff.v1"


def test_buf_curl_lists_prefill_through_reflection_v1(ops_cluster, tmp_path):
    result = buf_curl(tmp_path, f"http://{ops_cluster.prefill.address}", "--list-methods")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kvhandoff.v1.HandoffService/Prefill" in result.stdout


@pytest.mark.parametrize("method", ["/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                    "/grpc.reflection.v1alpha.ServerReflection/"
                                    "ServerReflectionInfo"])
def test_both_reflection_versions_answer_with_the_error_details(ops_cluster, method):
    request = reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="kvhandoff.v1.GenerationService")
    with grpc.insecure_channel(ops_cluster.address) as channel:
        call = channel.stream_stream(
            method, request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        (reply,) = list(call(iter([request]), timeout=10))
    names = [descriptor_pb2.FileDescriptorProto.FromString(raw).name
             for raw in reply.file_descriptor_response.file_descriptor_proto]
    assert "kvhandoff/v1/generate.proto" in names
    assert "google/rpc/error_details.proto" in names and "google/rpc/status.proto" in names
    assert names.index("google/protobuf/any.proto") < names.index("google/rpc/status.proto")
