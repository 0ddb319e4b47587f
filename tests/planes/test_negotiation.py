"""Which plane decode and prefill agree on (D-60, D-64, P-60, P-61)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from common.counters import Counters
from common.config import DecodeConfig, PrefillConfig, ServiceConfig
from common.handoff.binding import new_nonce
from common.handoff.layout import KvLayout
from common.handoff.planes import INLINE, SHARED_MEMORY, host_identity
from common.handoff.reasons import HandoffRefused, refuse
from common.handoff.transfer import TransferRecord, TransferState
from common.handoff.verifier import Expectation
from common.pb.kvhandoff.v1 import handoff_pb2
from common.sampling import SamplingConfig
from decode_svc.kv_receiver import HandoffJob, KvReceiver, LandedKv
from decode_svc.plane_select import NegotiatedReceiver, plane_for
from decode_svc.servicer import DecodeState
from prefill_svc.server import plane_offer
from prefill_svc.validation import PrefillLimits, validate_prefill
from tests.isolation.inproc import RecordingLog

SHM = handoff_pb2.DATA_PLANE_SHARED_MEMORY


def _info(host_id: str | None) -> handoff_pb2.GetPrefillInfoResponse:
    offers = [handoff_pb2.DataPlaneOffer(plane=handoff_pb2.DATA_PLANE_INLINE)]
    if host_id is not None:
        offers.insert(0, handoff_pb2.DataPlaneOffer(plane=SHM, host_id=host_id))
    return handoff_pb2.GetPrefillInfoResponse(data_planes=offers)


def _decode(tmp_path, plane: str, tls: bool = False, allow: bool = False) -> DecodeConfig:
    svc = ServiceConfig(shm_dir=str(tmp_path), tls_cert="c.pem" if tls else "",
                        tls_key="k.pem" if tls else "", allow_planes_without_tls=allow)
    return DecodeConfig(service=svc, data_plane=plane)


def test_auto_picks_shared_memory_on_the_same_host_and_inline_elsewhere(tmp_path):
    here = host_identity(str(tmp_path))
    assert here
    assert plane_for(_decode(tmp_path, "auto"), _info(here)) == (SHARED_MEMORY, "")
    assert plane_for(_decode(tmp_path, "auto"), _info("other-host:1:2")) == (INLINE, "")
    assert plane_for(_decode(tmp_path, "auto"), _info(None)) == (INLINE, "")
    # a prefill that predates data planes lists none: inline
    assert plane_for(_decode(tmp_path, "auto"), handoff_pb2.GetPrefillInfoResponse()) == (
        INLINE, "")


def test_a_named_plane_that_cannot_be_used_is_refused_not_replaced(tmp_path):
    plane, why = plane_for(_decode(tmp_path, "shared-memory"), _info("other-host:1:2"))
    assert plane == INLINE and "refusing all requests" in why
    assert plane_for(_decode(tmp_path, "inline"), _info(host_identity(str(tmp_path)))) == (
        INLINE, "")


def test_tls_turns_shared_memory_off_unless_allowed(tmp_path):
    here = _info(host_identity(str(tmp_path)))
    assert plane_for(_decode(tmp_path, "auto", tls=True), here) == (INLINE, "")
    plane, why = plane_for(_decode(tmp_path, "shared-memory", tls=True), here)
    assert plane == INLINE and "TLS" in why
    assert plane_for(_decode(tmp_path, "auto", tls=True, allow=True), here) == (
        SHARED_MEMORY, "")
    tls = ServiceConfig(shm_dir=str(tmp_path), tls_cert="c.pem", tls_key="k.pem")
    offers = plane_offer(PrefillConfig(service=tls), RecordingLog()).offers()
    assert [o.plane for o in offers] == [handoff_pb2.DATA_PLANE_INLINE]  # no shm, no NIXL
    allowed = ServiceConfig(shm_dir=str(tmp_path), tls_cert="c.pem", tls_key="k.pem",
                            allow_planes_without_tls=True)
    offers = plane_offer(PrefillConfig(service=allowed, nixl=False), RecordingLog()).offers()
    assert offers[0].plane == SHM


def test_prefill_rejects_a_plane_it_does_not_serve(tmp_path):
    limits = PrefillLimits(100, 64, 64, "fp", 8)  # default: inline only
    request = handoff_pb2.PrefillRequest(request_id="r", token_ids=[1, 2], nonce=b"n" * 16,
                                         data_plane=SHM)
    request.protocol_version.major, request.protocol_version.minor = 1, 1
    rejection = validate_prefill(request, limits)
    assert rejection is not None and rejection.reason_code == "DATA_PLANE_UNAVAILABLE"
    assert "shared-memory" in rejection.message
    offer = plane_offer(PrefillConfig(service=ServiceConfig(shm_dir=str(tmp_path))),
                        RecordingLog())
    served = PrefillLimits(100, 64, 64, "fp", 8, offer.served(), offer.shm_host_id)
    request.data_plane_host_id = "another-host:1:2"  # a replica on another host: rejected
    rejection = validate_prefill(request, served)
    assert rejection is not None and rejection.reason_code == "DATA_PLANE_UNAVAILABLE"
    assert "another host" in rejection.message
    request.data_plane_host_id = host_identity(str(tmp_path))
    assert validate_prefill(request, served) is None
    request.data_plane = handoff_pb2.DATA_PLANE_UNSPECIFIED
    assert validate_prefill(request, limits) is None  # a request that predates planes: inline


class _Receiver(KvReceiver):
    def __init__(self, error=None) -> None:
        self.error = error
        self.jobs: list[HandoffJob] = []

    async def receive(self, job, record):
        self.jobs.append(job)
        if self.error is not None:
            record.move(TransferState.FAILED, self.error.reason)
            raise self.error
        record.move(TransferState.SUCCESS)
        return LandedKv(7, 0, True)


def _plane_refusal() -> HandoffRefused:
    err = refuse("PEER_REJECTED", "prefill rejected the prompt (DATA_PLANE_UNAVAILABLE): ...",
                 grpc.StatusCode.FAILED_PRECONDITION)
    err.metadata["peer_reason"] = "DATA_PLANE_UNAVAILABLE"
    return err


def _job() -> HandoffJob:
    nonce = new_nonce()
    layout = KvLayout(1, 1, 4, torch.float32)
    return HandoffJob(handoff_pb2.PrefillRequest(request_id="r", token_ids=[1], nonce=nonce),
                      Expectation("r", 1, layout, "fp", 0, 10, nonce), SamplingConfig(), 5.0)


def test_auto_falls_back_inline_with_a_fresh_nonce_when_a_replica_rejects_the_plane():
    shm, inline, counters = _Receiver(_plane_refusal()), _Receiver(), Counters()
    state = DecodeState(plane=SHARED_MEMORY)
    receiver = NegotiatedReceiver({SHARED_MEMORY: shm, INLINE: inline}, state, True, counters)
    job = _job()
    landed = asyncio.run(receiver.receive(job, TransferRecord("r", SHARED_MEMORY)))
    assert landed.first_token == 7 and counters.snapshot() == {"data_plane_fallbacks": 1}
    retry = inline.jobs[0]
    assert retry.request.nonce != job.request.nonce and len(retry.request.nonce) == 16
    assert retry.expect.nonce == retry.request.nonce


def test_no_fallback_for_a_named_plane_or_another_rejection():
    state = DecodeState(plane=SHARED_MEMORY)
    strict = NegotiatedReceiver({SHARED_MEMORY: _Receiver(_plane_refusal()),
                                 INLINE: _Receiver()}, state, False)
    with pytest.raises(HandoffRefused):
        asyncio.run(strict.receive(_job(), TransferRecord("r", SHARED_MEMORY)))
    other = refuse("PEER_REJECTED", "too long", grpc.StatusCode.INVALID_ARGUMENT)
    other.metadata["peer_reason"] = "PROMPT_TOO_LONG"
    inline = _Receiver()
    auto = NegotiatedReceiver({SHARED_MEMORY: _Receiver(other), INLINE: inline}, state, True)
    with pytest.raises(HandoffRefused):
        asyncio.run(auto.receive(_job(), TransferRecord("r", SHARED_MEMORY)))
    assert inline.jobs == []
