"""The shared-memory plane on prefill: each chunk's K and V go into one region per handoff, and
the chunk frame carries a reference (region, offsets, length) with the same 1.1 checksums.

The region (common.handoff.shm_region) is opened on the first chunk, sized for the whole
handoff (2 x tokens x layers x bytes per token-layer), its file taken from the leases' region
pool when one is given (common.handoff.region_pool), filled in the order chunks are packed
(a reused pooled file: packed straight into it through its kept mapping; otherwise
pwritev of each chunk's views of the pages; prefill_svc.oob_sender), and its name unlinked by
`release`: decode's ReleaseHandoff (the file then goes back to the pool), or the stream's end
plus the grace period (prefill_svc.handoff_leases; the file is removed). The pool pages the KV
was packed from are freed as on the inline plane; the region is what stays pinned.
"""

from __future__ import annotations

import numpy as np

from common.handoff.layout import KvLayout
from common.handoff.planes import SHARED_MEMORY
from common.handoff.region_pool import RegionPool
from common.handoff.shm_region import RegionWriter
from common.pb.kvhandoff.v1 import handoff_pb2
from prefill_svc.oob_sender import OutOfBandSender


class SharedMemorySender(OutOfBandSender):
    plane = SHARED_MEMORY

    def __init__(self, request_id: str, layout: KvLayout, num_tokens: int, directory: str,
                 regions: RegionPool | None = None) -> None:
        super().__init__(request_id, layout, num_tokens)
        self.directory = directory
        self.regions = regions
        self._region: RegionWriter | None = None
        self.region_name = ""  # known once the first chunk created the region

    def _open(self) -> np.ndarray | None:
        """A reused pooled file: its bytes through the file's kept mapping, packed into in place
        (one copy out of the pages, no system call); a new file or a region of its own: None
        (pwritev)."""
        self._region = RegionWriter(self.directory, self.size, self.regions)
        self.region_name = self._region.name
        return self._region.writable()

    def _write(self, offset: int, data: np.ndarray) -> None:
        self._region.write(offset, data)

    def _reference(self, k_offset: int, v_offset: int, length: int, first: bool
                   ) -> handoff_pb2.KvRegionRef:
        return handoff_pb2.KvRegionRef(region=self.region_name, k_offset=k_offset,
                                       v_offset=v_offset, length=length)

    def _close(self) -> None:
        self._region.close(recycle=self.peer_done, written=self._cursor)
