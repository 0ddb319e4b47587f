"""The handoff service accepts only peers with a certificate signed by the cluster CA (mutual
TLS), and decode, given the same --tls-* flags, speaks to prefill over that channel."""

from __future__ import annotations

import grpc
import pytest

from common.errors import error_reason
from common.pb.kvhandoff.v1 import (
    generate_pb2,
    generate_pb2_grpc,
    handoff_pb2,
    stats_pb2,
    stats_pb2_grpc,
)
from tests.helpers.cluster import generate, handoff_stub
from tests.isolation.launch import start
from tests.security.secure_cluster import MODEL_FLAGS, Pki, start_secure_prefill, wait_log

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtls")
    pki = Pki.create(root / "pki")
    prefill = start_secure_prefill(pki, root / "prefill")
    try:
        yield pki, prefill, root
    finally:
        prefill.stop()


def _info(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.RpcError | None:
    channel = (grpc.secure_channel(address, credentials) if credentials
               else grpc.insecure_channel(address))
    with channel:
        try:
            handoff_stub(channel).GetPrefillInfo(handoff_pb2.GetPrefillInfoRequest(), timeout=5)
            return None
        except grpc.RpcError as err:
            return err


def test_a_cluster_certificate_is_accepted(secured):
    pki, prefill, _ = secured
    assert _info(prefill.address, pki.decode.channel_credentials()) is None


@pytest.mark.parametrize("peer", ["plaintext", "no_client_certificate",
                                  "certificate_of_another_ca"])
def test_other_peers_are_refused_at_the_handshake(secured, peer):
    pki, prefill, _ = secured
    credentials = {
        "plaintext": None,
        "no_client_certificate": pki.decode.channel_credentials(present_cert=False),
        "certificate_of_another_ca": pki.intruder.channel_credentials(),
    }[peer]
    err = _info(prefill.address, credentials)
    assert err is not None, f"{peer} was let in"
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err


def _prefill_counters(pki: Pki, address: str) -> dict[str, int]:
    with grpc.secure_channel(address, pki.decode.channel_credentials()) as channel:
        return dict(stats_pb2_grpc.StatsServiceStub(channel).GetStats(
            stats_pb2.GetStatsRequest(), timeout=10).counters)


def test_decode_with_the_cluster_certificate_generates_over_mtls(secured):
    pki, prefill, root = secured
    before = _prefill_counters(pki, prefill.address).get("handoffs_completed", 0)
    decode = start("decode", root / "decode-ok", [*MODEL_FLAGS, "--prefill", prefill.address,
                                                  *pki.decode.flags()])
    try:
        got = generate(decode.address, token_ids=[3, 4, 5, 6, 7], max_tokens=6, ignore_eos=True)
        assert len(got.token_ids) == 6
        assert _prefill_counters(pki, prefill.address)["handoffs_completed"] == before + 1
    finally:
        decode.stop()


@pytest.mark.parametrize("identity", ["none", "intruder"])
def test_decode_without_a_trusted_certificate_never_reaches_prefill(secured, identity):
    """The handshake with prefill fails, so decode refuses every request (PREFILL_NOT_READY)."""
    pki, prefill, root = secured
    flags = [] if identity == "none" else pki.intruder.flags()
    decode = start("decode", root / f"decode-{identity}",
                   [*MODEL_FLAGS, "--prefill", prefill.address, *flags], wait_healthy=False)
    try:
        wait_log(decode.log_path, "prefill_tls_failed", decode.proc)  # names TLS, not "unreachable"
        request = generate_pb2.GenerateRequest(max_tokens=4)
        request.token_ids.ids.extend([3, 4, 5])
        with (grpc.insecure_channel(decode.address) as channel,
              pytest.raises(grpc.RpcError) as info):
            list(generate_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error_reason(info.value) == "PREFILL_NOT_READY"
        assert "prefill_agreed" not in decode.log_text()
    finally:
        decode.stop()
