"""Which data plane decode uses with its prefill: chosen at the handshake, used per request.

`NegotiatedReceiver` is the one KvReceiver the servicer holds when decode talks to a prefill
service: it hands each request to the receiver of the plane the last handshake agreed on
(DecodeState.plane). `plane_for` is that agreement: with --data-plane auto the fastest plane
both sides can use (D-60); with a named plane that plane or nothing — decode then refuses to
serve rather than fall back silently (D-61); never a plane that bypasses TLS when TLS is
configured, unless the operator allowed it (D-64).
"""

from __future__ import annotations

from common.counters import Counters

import dataclasses
from typing import TYPE_CHECKING

from common.config import DecodeConfig
from common.handoff.binding import new_nonce
from common.handoff.planes import INLINE, choose_plane
from common.handoff.reasons import HandoffRefused
from common.handoff.transfer import TransferRecord
from common.pb.kvhandoff.v1 import handoff_pb2
from decode_svc.kv_receiver import HandoffJob, KvReceiver, LandedKv

if TYPE_CHECKING:
    from decode_svc.servicer import DecodeState


def plane_for(config: DecodeConfig, info, nixl: bool = False) -> tuple[str, str]:
    """-> (plane, '') or (INLINE, why decode must refuse to serve). nixl: decode has a NIXL
    agent (decode_svc.nixl_receiver), opened only when TLS allows out-of-band planes."""
    svc = config.service
    allow_out_of_band = not svc.tls_cert or svc.allow_planes_without_tls
    plane = choose_plane(info, config.data_plane, svc.shm_dir, allow_out_of_band,
                         nixl and allow_out_of_band)
    if config.data_plane not in ("auto", plane):
        why = ("TLS is configured and that plane bypasses it (--allow-planes-without-tls "
               "allows it)" if not allow_out_of_band else
               "prefill does not offer it on this host (another host, another shared-memory "
               "directory, the plane is off there, or NIXL does not load here)")
        return INLINE, (f"decode is configured for data plane {config.data_plane} but {why}; "
                        "refusing all requests (--data-plane auto falls back to inline)")
    return plane, ""


def plane_rejected(err: HandoffRefused) -> bool:
    """prefill refused the plane, not the prompt (P-61): nothing was computed or sent."""
    return (err.reason == "PEER_REJECTED"
            and err.metadata.get("peer_reason") == "DATA_PLANE_UNAVAILABLE")


class NegotiatedReceiver(KvReceiver):
    """fallback (--data-plane auto): a request whose plane the serving replica rejects is asked
    again inline, with a fresh nonce (D-40), counted as data_plane_fallbacks (D-66)."""

    def __init__(self, receivers: dict[str, KvReceiver], state: DecodeState,
                 fallback: bool = False, counters: Counters | None = None) -> None:
        self.receivers = receivers
        self.state = state
        self.fallback = fallback
        self.counters = counters if counters is not None else Counters()

    @property
    def plane(self) -> str:  # type: ignore[override]
        return self.state.plane

    async def receive(self, job: HandoffJob, record: TransferRecord) -> LandedKv:
        plane = self.state.plane
        try:
            return await self.receivers[plane].receive(job, record)
        except HandoffRefused as err:
            if plane == INLINE or not self.fallback or not plane_rejected(err):
                raise
        self.counters.add("data_plane_fallbacks")
        nonce = new_nonce()
        request = handoff_pb2.PrefillRequest()
        request.CopyFrom(job.request)
        request.nonce = nonce
        retry = HandoffJob(request, dataclasses.replace(job.expect, nonce=nonce), job.sampling,
                           job.timeout_s)
        return await self.receivers[INLINE].receive(
            retry, TransferRecord(record.request_id, INLINE))
