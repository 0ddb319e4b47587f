"""What the decode receivers of the out-of-band planes (shared memory, NIXL) share: the
PrefillRequest that names the plane, one landing per handoff (it turns each chunk's reference
into decode's own copy, and is closed however the handoff ends), and the ReleaseHandoff sent
afterwards, off the request's path (D-65).

Invariants (besides KvReceiver's): `landing.close()` runs, and ReleaseHandoff is sent, once per
handoff whatever ended it; a release that fails changes nothing here (prefill's grace period,
P-63, frees what it pinned). Event loop only.
"""

from __future__ import annotations

import asyncio

from common.handoff.planes import TO_PROTO
from common.handoff.transfer import TransferRecord
from common.pb.kvhandoff.v1 import handoff_pb2
from decode_svc.engine import DecodeEngine
from decode_svc.handoff import Deliver, receive_handoff
from decode_svc.kv_receiver import HandoffJob, KvReceiver, LandedKv
from decode_svc.prefill_client import PrefillClient

RELEASE_TIMEOUT_S = 5.0


class OutOfBandReceiver(KvReceiver):
    def __init__(self, client: PrefillClient, engine: DecodeEngine) -> None:
        self.client = client
        self.engine = engine
        self._releases: set[asyncio.Task] = set()

    def _request(self, job: HandoffJob) -> handoff_pb2.PrefillRequest:
        """job's PrefillRequest naming this receiver's plane."""
        request = handoff_pb2.PrefillRequest()
        request.CopyFrom(job.request)
        request.data_plane = TO_PROTO[self.plane]
        return request

    async def _receive_through(self, landing, request: handoff_pb2.PrefillRequest,
                               job: HandoffJob, record: TransferRecord,
                               deliver: Deliver | None = None) -> LandedKv:
        """The handoff with landing.resolve on each frame (and deliver, if given, on each
        verified chunk); then the landing closed and the release sent."""
        try:
            return await receive_handoff(self.client, self.engine, request, job.expect,
                                         job.timeout_s, record, landing.resolve, deliver)
        finally:
            landing.close()
            self._release_later(request.request_id, bytes(request.nonce))

    def _release_later(self, request_id: str, nonce: bytes) -> None:
        """Off the request's path: the tokens need not wait for prefill's acknowledgement."""
        task = asyncio.ensure_future(self._release(request_id, nonce))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, request_id: str, nonce: bytes) -> None:
        try:
            await self.client.release(request_id, nonce, RELEASE_TIMEOUT_S)
        except Exception:  # prefill gone or slow: its grace period frees what it pinned
            pass
