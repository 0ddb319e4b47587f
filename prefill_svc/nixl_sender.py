"""The NIXL plane on prefill: each handoff's K and V go into one host buffer registered with
prefill's NIXL agent; the chunk frames carry references (address, offsets, length, and on the
first chunk the buffer's partial agent metadata) with the same 1.1 checksums, and decode READs
the bytes into its own memory (a one-sided transfer decode initiates: prefill never writes into
decode, and decode never exposes its pool). The buffers come from the plane's
`RegisteredBuffers` and go back to it on release, registered, for a later handoff. This packed
path (P-66) serves a GPU pool and every fallback; a host-memory pool's handoffs are READ straight
from its pages (prefill_svc.nixl_pages_sender, P-68).

`NixlPlane` is the process's agent plus the thread that progresses it: without NIXL's own
progress thread (it spins a core per agent) a READ against prefill's memory completes only when
prefill's worker progresses, so the thread progresses it often while a chunk was emitted in the
last HOT_S seconds, rarely while buffers are merely pinned or for LINGER_S after the last one
was released (a READ posted late, after its handoff's release, then still ends, so the decode
that posted it gets its quarantined pages back: D-67a; it lands bytes its checksums refuse,
P-68), and not at all otherwise.

Invariants (besides KvSender's): the buffer is registered before the first frame naming it is
returned, every byte a frame names is written before the frame is returned, and the buffer stays
registered and unchanged until `release` (decode's ReleaseHandoff, or the stream's end plus the
grace period: prefill_svc.handoff_leases), which hands it back to the plane's buffers (kept
registered for a later handoff, or deregistered when too many are idle).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from common.handoff.layout import KvLayout
from common.handoff.nixl_agent import NixlAgent, Registration
from common.handoff.planes import NIXL
from common.pb.kvhandoff.v1 import handoff_pb2
from common.handoff.nixl_buffers import DEFAULT_MAX_IDLE_BYTES, RegisteredBuffers
from prefill_svc.oob_sender import OutOfBandSender

HOT_S = 0.5
HOT_PAUSE_S = 50e-6
COLD_PAUSE_S = 2e-3
LINGER_S = 30.0


class NixlPlane:
    """prefill's agent and its progress thread; close() stops the thread (shutdown only)."""

    def __init__(self, agent: NixlAgent,
                 max_idle_bytes: int = DEFAULT_MAX_IDLE_BYTES) -> None:
        self.agent = agent
        self.metadata = agent.metadata()
        self.buffers = RegisteredBuffers(agent, True, max_idle_bytes)
        self._pinned = 0
        self._last_emit = 0.0
        self._last_unpinned = float("-inf")
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._progress, name="nixl-progress", daemon=True)
        self._thread.start()

    def pinned(self, delta: int) -> None:
        with self._wake:
            self._pinned += delta
            if self._pinned == 0:
                self._last_unpinned = time.monotonic()
            self._wake.notify()

    def emitted(self) -> None:
        self._last_emit = time.monotonic()

    def _progress(self) -> None:
        while True:
            with self._wake:
                while self._pinned == 0 and not self._stopped:
                    idle = time.monotonic() - self._last_unpinned
                    if idle < LINGER_S:  # a late READ may still be posted: keep answering
                        break
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
        self.buffers.close()


class NixlSender(OutOfBandSender):
    plane = NIXL

    def __init__(self, request_id: str, layout: KvLayout, num_tokens: int, nixl: NixlPlane
                 ) -> None:
        super().__init__(request_id, layout, num_tokens)
        self.nixl = nixl
        self._pinned: np.ndarray | None = None  # [>= size] uint8, registered with the agent
        self._reg: Registration | None = None

    def _open(self) -> np.ndarray:
        self._pinned, self._reg = self.nixl.buffers.acquire(self.size)
        self.nixl.pinned(+1)
        return self._pinned

    def _reference(self, k_offset: int, v_offset: int, length: int, first: bool
                   ) -> handoff_pb2.KvRegionRef:
        self.nixl.emitted()
        reg = self._reg
        return handoff_pb2.KvRegionRef(
            k_offset=k_offset, v_offset=v_offset, length=length, nixl_address=reg.address,
            nixl_buffer_size=reg.size, nixl_buffer_metadata=reg.metadata if first else b"")

    def _close(self) -> None:
        pinned, reg, self._pinned, self._reg = self._pinned, self._reg, None, None
        self.nixl.buffers.give_back(pinned, reg)
        self.nixl.pinned(-1)
