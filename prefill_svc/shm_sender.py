"""The shared-memory plane on prefill: each chunk's K and V go into one region per handoff, and
the chunk frame carries a reference (region, offsets, length) with the same 1.1 checksums.

The region (common.handoff.shm_region) is created on the first chunk, sized for the whole
handoff (2 x tokens x layers x bytes per token-layer), filled in the order chunks are packed, and
unlinked by `release`: decode's ReleaseHandoff, or the stream's end plus the grace period
(prefill_svc.handoff_leases). The pool pages the KV was packed from are freed as on the inline
plane; the region is what stays pinned.
"""

from __future__ import annotations

import threading

import torch

from common.handoff.crc import payload_crc32c
from common.handoff.binding import chunk_checksum, chunk_metadata
from common.handoff.codec import frame_wire, kv_buffers
from common.handoff.layout import KvLayout
from common.handoff.planes import SHARED_MEMORY
from common.handoff.shm_region import RegionWriter
from common.pb.kvhandoff.v1 import handoff_pb2
from prefill_svc.kv_sender import KvSender


class SharedMemorySender(KvSender):
    plane = SHARED_MEMORY
    pins_bytes = True

    def __init__(self, request_id: str, layout: KvLayout, num_tokens: int, directory: str
                 ) -> None:
        super().__init__(request_id)
        self.size = num_tokens * layout.kv_bytes_per_token
        self.directory = directory
        self._region: RegionWriter | None = None
        self._cursor = 0
        self._lock = threading.Lock()  # chunk (engine thread) vs release (event loop)
        self._released = False

    @property
    def region_name(self) -> str:
        return self._region.name if self._region is not None else ""

    def chunk(self, request_id: str, sequence_number: int, layer: int, token_start: int,
              kv: torch.Tensor, nonce: bytes) -> bytes | None:
        k, v = kv_buffers(kv)
        with self._lock:
            if self._released or not self._sending():
                return None
            if self._region is None:
                self._region = RegionWriter(self.directory, self.size)
            k_offset, v_offset = self._cursor, self._cursor + len(k)
            self._region.write(k_offset, k)
            self._region.write(v_offset, v)
            self._cursor = v_offset + len(v)
            name = self._region.name
        token_end = token_start + kv.shape[1]
        crc = payload_crc32c(k, v)
        meta = chunk_metadata(request_id, nonce, sequence_number, layer, token_start, token_end)
        return frame_wire(handoff_pb2.PrefillResponse(chunk=handoff_pb2.KvChunk(
            request_id=request_id, sequence_number=sequence_number, layer=layer,
            token_start=token_start, token_end=token_end, crc32c=crc, nonce=nonce,
            chunk_crc32c=chunk_checksum(crc, meta),
            ref=handoff_pb2.KvRegionRef(region=name, k_offset=k_offset, v_offset=v_offset,
                                        length=len(k)))))

    def release(self, committed: bool) -> None:
        with self._lock:
            self._released = True
            if self._region is not None:
                self._region.close()
        super().release(committed)
