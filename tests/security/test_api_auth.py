"""Decode's client-facing API with --api-tls-cert/--api-tls-key and --api-token: only TLS
clients that send `authorization: Bearer <token>` get work done; health stays open; a refused
call never reaches prefill and leaves nothing behind. The handoff channel is mTLS throughout."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2

from common.pb.kvhandoff.v1 import generate_pb2, generate_pb2_grpc, stats_pb2, stats_pb2_grpc
from common.server.wait import wait_serving
from tests.helpers.cluster import START_TIMEOUT
from tests.isolation.launch import start
from tests.security.secure_cluster import (
    MODEL_FLAGS,
    TOKEN,
    start_secure_prefill,
    Pki,
    health_status,
)

pytestmark = pytest.mark.slow

PROMPT = [3, 9, 27, 81, 50]  # the demo vocabulary has 98 ids


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    pki = Pki.create(root / "pki")
    prefill = start_secure_prefill(pki, root / "run")
    decode = None
    try:
        decode = start("decode", root / "run", [
            *MODEL_FLAGS, "--prefill", prefill.address, *pki.decode.flags(),
            "--api-tls-cert", str(pki.api.cert), "--api-tls-key", str(pki.api.key),
            "--api-token", TOKEN], wait_healthy=False)
        api = grpc.ssl_channel_credentials(root_certificates=pki.api.ca.read_bytes())
        wait_serving(decode.address, START_TIMEOUT, credentials=api, proc=decode.proc)
        yield pki, prefill, decode, api
    finally:
        for service in (decode, prefill):
            if service is not None:
                service.stop()


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _generate(channel: grpc.Channel, metadata) -> list[int]:
    request = generate_pb2.GenerateRequest(max_tokens=5, ignore_eos=True)
    request.token_ids.ids.extend(PROMPT)
    stream = generate_pb2_grpc.GenerationServiceStub(channel).Generate(
        request, timeout=60, metadata=metadata)
    return [r.token.token_id for r in stream if r.HasField("token")]


def _stats(channel: grpc.Channel, metadata) -> stats_pb2.GetStatsResponse:
    return stats_pb2_grpc.StatsServiceStub(channel).GetStats(
        stats_pb2.GetStatsRequest(), timeout=10, metadata=metadata)


def _prefill_forward_passes(pki: Pki, prefill) -> int:
    with grpc.secure_channel(prefill.address, pki.decode.channel_credentials()) as channel:
        return _stats(channel, None).counters.get("forward_passes", 0)


def test_the_right_token_over_tls_generates(secured):
    _, _, decode, api = secured
    with grpc.secure_channel(decode.address, api) as channel:
        first = _generate(channel, _bearer(TOKEN))
        assert len(first) == 5
        assert _generate(channel, _bearer(TOKEN)) == first  # greedy: the same again
        pool = _stats(channel, _bearer(TOKEN)).pool
        assert pool.pages_free == pool.pages_total


@pytest.mark.parametrize("metadata", [
    None,
    _bearer("wrong-token"),
    _bearer(TOKEN + "x"),
    (("authorization", TOKEN),),  # the token without the Bearer scheme
    (("authorization", f"Basic {TOKEN}"),),
    (("authorization", f"Bearer {TOKEN}"), ("authorization", "Bearer wrong-token")),
], ids=["missing", "wrong", "longer", "no_scheme", "basic_scheme", "two_tokens"])
def test_a_missing_or_wrong_token_is_unauthenticated(secured, metadata):
    pki, prefill, decode, api = secured
    passes = _prefill_forward_passes(pki, prefill)
    with grpc.secure_channel(decode.address, api) as channel:
        with pytest.raises(grpc.RpcError) as generate_err:
            _generate(channel, metadata)
        with pytest.raises(grpc.RpcError) as stats_err:
            _stats(channel, metadata)
        for err in (generate_err.value, stats_err.value):
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
        pool = _stats(channel, _bearer(TOKEN)).pool
    assert pool.pages_free == pool.pages_total
    assert _prefill_forward_passes(pki, prefill) == passes  # never reached prefill


def test_a_plaintext_client_is_refused(secured):
    _, _, decode, _ = secured
    with grpc.insecure_channel(decode.address) as channel, pytest.raises(grpc.RpcError) as err:
        _generate(channel, _bearer(TOKEN))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_that_does_not_trust_the_server_is_refused(secured):
    """TLS is not decorative: a client with other roots cannot verify decode's certificate."""
    pki, _, decode, _ = secured
    foreign = grpc.ssl_channel_credentials(root_certificates=pki.intruder.cert.read_bytes())
    with (grpc.secure_channel(decode.address, foreign) as channel,
          pytest.raises(grpc.RpcError) as err):
        _generate(channel, _bearer(TOKEN))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_health_stays_open_without_a_token(secured):
    _, _, decode, api = secured
    with grpc.secure_channel(decode.address, api) as channel:
        assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
