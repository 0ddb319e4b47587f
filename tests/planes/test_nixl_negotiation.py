"""Which plane decode and prefill agree on when NIXL is in play (D-60, D-64, D-67, P-60, P-65)."""

from __future__ import annotations

from common.config import DecodeConfig, PrefillConfig, ServiceConfig
from common.handoff.planes import INLINE, NIXL, SHARED_MEMORY, choose_plane, host_identity
from common.pb.kvhandoff.v1 import handoff_pb2
from decode_svc.nixl_receiver import nixl_receivers
from decode_svc.plane_select import plane_for
from prefill_svc.server import plane_offer
from tests.isolation.inproc import RecordingLog
from tests.planes.nixl_env import nixl_or_skip


def _info(host_id: str, metadata: bytes = b"agent-md") -> handoff_pb2.GetPrefillInfoResponse:
    return handoff_pb2.GetPrefillInfoResponse(data_planes=[
        handoff_pb2.DataPlaneOffer(plane=handoff_pb2.DATA_PLANE_NIXL,
                                   nixl_agent_metadata=metadata),
        handoff_pb2.DataPlaneOffer(plane=handoff_pb2.DATA_PLANE_SHARED_MEMORY, host_id=host_id),
        handoff_pb2.DataPlaneOffer(plane=handoff_pb2.DATA_PLANE_INLINE)])


def _decode(tmp_path, plane: str, tls: bool = False, allow: bool = False) -> DecodeConfig:
    svc = ServiceConfig(shm_dir=str(tmp_path), tls_cert="c.pem" if tls else "",
                        tls_key="k.pem" if tls else "", allow_planes_without_tls=allow)
    return DecodeConfig(service=svc, data_plane=plane)


def test_auto_prefers_shared_memory_then_nixl(tmp_path):
    here = _info(host_identity(str(tmp_path)))
    assert plane_for(_decode(tmp_path, "auto"), here, nixl=True) == (SHARED_MEMORY, "")
    # another host (shared memory unusable), both with an agent: NIXL
    assert plane_for(_decode(tmp_path, "auto"), _info("other-host:1:2"), nixl=True) == (
        NIXL, "")
    # decode without an agent (no wheel, backend failed): what else both can use
    assert plane_for(_decode(tmp_path, "auto"), here, nixl=False) == (SHARED_MEMORY, "")
    assert plane_for(_decode(tmp_path, "auto"), _info("other-host:1:2"), nixl=False) == (
        INLINE, "")
    # an offer without metadata is not usable
    assert choose_plane(_info("x", b""), "auto", str(tmp_path), True, True) == INLINE


def test_a_named_nixl_plane_is_refused_not_replaced(tmp_path):
    plane, why = plane_for(_decode(tmp_path, "nixl"), _info("x"), nixl=False)
    assert plane == INLINE and "NIXL" in why and "refusing" in why
    no_offer = handoff_pb2.GetPrefillInfoResponse(data_planes=[
        handoff_pb2.DataPlaneOffer(plane=handoff_pb2.DATA_PLANE_INLINE)])
    plane, why = plane_for(_decode(tmp_path, "nixl"), no_offer, nixl=True)
    assert plane == INLINE and why


def test_tls_turns_nixl_off_unless_allowed(tmp_path):
    info = _info("other-host:1:2")
    assert plane_for(_decode(tmp_path, "auto", tls=True), info, nixl=True) == (INLINE, "")
    plane, why = plane_for(_decode(tmp_path, "nixl", tls=True), info, nixl=True)
    assert plane == INLINE and "TLS" in why
    assert plane_for(_decode(tmp_path, "auto", tls=True, allow=True), info, nixl=True) == (
        NIXL, "")
    # and decode does not even start an agent then
    assert nixl_receivers(_decode(tmp_path, "auto", tls=True), None, None, None,
                          RecordingLog()) == {}


def test_prefill_offers_nixl_first_with_metadata_and_not_under_tls(tmp_path):
    nixl_or_skip()
    offer = plane_offer(PrefillConfig(service=ServiceConfig(shm_dir=str(tmp_path))),
                        RecordingLog())
    try:
        planes = [o.plane for o in offer.offers()]
        assert planes == [handoff_pb2.DATA_PLANE_SHARED_MEMORY, handoff_pb2.DATA_PLANE_NIXL,
                          handoff_pb2.DATA_PLANE_INLINE]
        assert offer.offers()[1].nixl_agent_metadata == offer.nixl.metadata
        assert handoff_pb2.DATA_PLANE_NIXL in offer.served()
    finally:
        offer.nixl.close()
    tls = ServiceConfig(shm_dir=str(tmp_path), tls_cert="c.pem", tls_key="k.pem")
    assert plane_offer(PrefillConfig(service=tls), RecordingLog()).nixl is None
    off = plane_offer(PrefillConfig(service=ServiceConfig(shm_dir=str(tmp_path)), nixl=False),
                      RecordingLog())
    assert off.nixl is None and handoff_pb2.DATA_PLANE_NIXL not in off.served()
