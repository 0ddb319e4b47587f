"""The NIXL plane on prefill: each handoff's K and V go into one host buffer registered with
prefill's NIXL agent; the chunk frames carry references (address, offsets, length, and on the
first chunk the buffer's partial agent metadata) with the same 1.1 checksums, and decode READs
the bytes into its own memory (a one-sided transfer decode initiates: prefill never writes into
decode, and decode never exposes its pool).

`NixlPlane` is the process's agent plus the thread that progresses it: without NIXL's own
progress thread (it spins a core per agent) a READ against prefill's memory completes only when
prefill's worker progresses, so the thread progresses it often while a chunk was emitted in the
last HOT_S seconds, rarely while buffers are merely pinned, and not at all when none is.

Invariants (besides KvSender's): the buffer is registered before the first frame naming it is
returned, every byte a frame names is written before the frame is returned, and the buffer stays
registered and unchanged until `release` (decode's ReleaseHandoff, or the stream's end plus the
grace period: prefill_svc.handoff_leases), which deregisters it and drops it for good.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from common.handoff.binding import chunk_checksum, chunk_metadata
from common.handoff.codec import frame_wire, kv_buffers
from common.handoff.crc import payload_crc32c
from common.handoff.layout import KvLayout
from common.handoff.nixl_agent import NixlAgent, Registration
from common.handoff.planes import NIXL
from common.pb.kvhandoff.v1 import handoff_pb2
from prefill_svc.kv_sender import KvSender

HOT_S = 0.5
HOT_PAUSE_S = 50e-6
COLD_PAUSE_S = 2e-3


class NixlPlane:
    """prefill's agent and its progress thread; close() stops the thread (shutdown only)."""

    def __init__(self, agent: NixlAgent) -> None:
        self.agent = agent
        self.metadata = agent.metadata()
        self._pinned = 0
        self._last_emit = 0.0
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._progress, name="nixl-progress", daemon=True)
        self._thread.start()

    def pinned(self, delta: int) -> None:
        with self._wake:
            self._pinned += delta
            self._wake.notify()

    def emitted(self) -> None:
        self._last_emit = time.monotonic()

    def _progress(self) -> None:
        while True:
            with self._wake:
                while self._pinned == 0 and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    return
            self.agent.progress()
            hot = time.monotonic() - self._last_emit < HOT_S
            time.sleep(HOT_PAUSE_S if hot else COLD_PAUSE_S)

    def close(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=5)


class NixlSender(KvSender):
    plane = NIXL
    pins_bytes = True

    def __init__(self, request_id: str, layout: KvLayout, num_tokens: int, nixl: NixlPlane
                 ) -> None:
        super().__init__(request_id)
        self.size = num_tokens * layout.kv_bytes_per_token
        self.nixl = nixl
        self._pinned: np.ndarray | None = None  # [size] uint8, registered with the agent
        self._reg: Registration | None = None
        self._cursor = 0
        self._lock = threading.Lock()  # chunk (engine thread) vs release (event loop)
        self._released = False

    def chunk(self, request_id: str, sequence_number: int, layer: int, token_start: int,
              kv: torch.Tensor, nonce: bytes) -> bytes | None:
        k, v = kv_buffers(kv)
        with self._lock:
            if self._released or not self._sending():
                return None
            first = self._reg is None
            if first:
                self._pinned = np.empty(self.size, dtype=np.uint8)
                self._reg = self.nixl.agent.register(self._pinned, share=True)
                self.nixl.pinned(+1)
            k_offset, v_offset = self._cursor, self._cursor + len(k)
            self._pinned[k_offset:v_offset] = np.frombuffer(k, dtype=np.uint8)
            self._pinned[v_offset:v_offset + len(v)] = np.frombuffer(v, dtype=np.uint8)
            self._cursor = v_offset + len(v)
            reg = self._reg
        self.nixl.emitted()
        token_end = token_start + kv.shape[1]
        crc = payload_crc32c(k, v)
        meta = chunk_metadata(request_id, nonce, sequence_number, layer, token_start, token_end)
        return frame_wire(handoff_pb2.PrefillResponse(chunk=handoff_pb2.KvChunk(
            request_id=request_id, sequence_number=sequence_number, layer=layer,
            token_start=token_start, token_end=token_end, crc32c=crc, nonce=nonce,
            chunk_crc32c=chunk_checksum(crc, meta),
            ref=handoff_pb2.KvRegionRef(
                k_offset=k_offset, v_offset=v_offset, length=len(k), nixl_address=reg.address,
                nixl_buffer_size=reg.size, nixl_buffer_metadata=reg.metadata if first else b""))))

    def release(self, committed: bool) -> None:
        with self._lock:
            self._released = True
            reg, self._reg, self._pinned = self._reg, None, None
            if reg is not None:
                self.nixl.agent.deregister(reg)
                self.nixl.pinned(-1)
        super().release(committed)
