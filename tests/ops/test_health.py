"""grpc.health.v1, server reflection and rich error details on both services, and the
health probe the compose healthchecks run."""

from __future__ import annotations

import socket
import subprocess
import sys

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)
from grpc_status import rpc_status

from common.errors import ERROR_DOMAIN
from common.pb.kvhandoff.v1 import handoff_pb2
from tests.helpers.cluster import REPO, handoff_stub
from tests.ops.helpers import generate_reply

pytestmark = pytest.mark.slow

DECODE_SERVICES = {"kvhandoff.v1.GenerationService", "kvhandoff.v1.StatsService"}
PREFILL_SERVICES = {"kvhandoff.v1.HandoffService", "kvhandoff.v1.StatsService"}


def _probe(target: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvhandoff_cli.health_probe", target, *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def test_both_services_report_serving_for_every_service(ops_cluster):
    for service, names in ((ops_cluster.decode, DECODE_SERVICES),
                           (ops_cluster.prefill, PREFILL_SERVICES)):
        with grpc.insecure_channel(service.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for name in ["", *names]:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, (service, name)


def test_health_probe_exit_status(ops_cluster):
    ok = _probe(ops_cluster.decode.address)
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    named = _probe(ops_cluster.prefill.address, "--service", "kvhandoff.v1.HandoffService")
    assert named.returncode == 0
    unknown = _probe(ops_cluster.prefill.address, "--service", "no.such.Service")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stdout
    assert "UNREACHABLE" not in unknown.stdout  # the server answered: it does not know it
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    down = _probe(closed, "--timeout", "1")
    assert down.returncode == 1 and "UNREACHABLE" in down.stdout
    assert _probe(closed, "--timeout", "0").returncode == 2


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_reflection_lists_the_kvhandoff_services(ops_cluster, role):
    service = getattr(ops_cluster, role)
    expected = DECODE_SERVICES if role == "decode" else PREFILL_SERVICES
    with grpc.insecure_channel(service.address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        names = set(db.get_services())
        assert expected | {"grpc.health.v1.Health"} <= names, names
        pool = DescriptorPool(db)
        main = "kvhandoff.v1.GenerationService" if role == "decode" else \
            "kvhandoff.v1.HandoffService"
        methods = set(pool.FindServiceByName(main).methods_by_name)
    assert methods == ({"Generate"} if role == "decode"
                       else {"Prefill", "GetPrefillInfo", "ReleaseHandoff"})


def _error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    status = rpc_status.from_call(err)
    assert status is not None, "no grpc-status-details-bin on the error"
    assert status.code == err.code().value[0] and status.message == err.details()
    (detail,) = status.details
    info = error_details_pb2.ErrorInfo()
    assert detail.Unpack(info)
    return info


def test_decode_errors_carry_error_info(ops_cluster):
    with pytest.raises(grpc.RpcError) as caught:
        generate_reply(ops_cluster.address, [10**6], 2)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = _error_info(caught.value)
    assert (info.domain, info.reason) == (ERROR_DOMAIN, "TOKEN_OUT_OF_VOCAB")
    assert "vocabulary" in caught.value.details()
    ops_cluster.assert_pools_at_baseline()


def test_prefill_errors_carry_error_info(ops_cluster):
    request = handoff_pb2.PrefillRequest(request_id="", token_ids=[1, 2, 3])
    with grpc.insecure_channel(ops_cluster.prefill.address) as channel:
        call = handoff_stub(channel).Prefill(request, timeout=30)
        with pytest.raises(grpc.RpcError) as caught:
            frames = list(call)
            raise AssertionError(f"prefill accepted a request without an id: {frames[:1]}")
    info = _error_info(caught.value)
    assert info.domain == ERROR_DOMAIN and info.reason == "MISSING_REQUEST_ID", info
    ops_cluster.assert_pools_at_baseline()
