"""The NIXL plane served straight from prefill's KV pages (SPEC P-68): no pack copy, no buffer of
its own. Each chunk is one layer x one run of contiguous page slots, so its K and its V are each
one contiguous range of the pool; its KvRegionRef names them relative to the pool's span
(`nixl_address` = the lower of the K and V tensors' addresses, `nixl_buffer_size` = the span of
both), and the first chunk carries the partial agent metadata of this handoff's registration.

Only the handoff's own slots are registered with the agent (one region per layer and run, K and
V apart, tokens [0, n) of its table), on the first chunk, and deregistered at `release` before
its pages go back to the pool. Before registering, the slots not written yet are zeroed
(prefill_svc.page_scrub, P-68a), so the peer can READ, within the registration, only zeros or
this request's own KV, never what an earlier owner of a page left there. The engine passes
the pages to a hold owner (`hold`) when it is done with the job, so they stay out of the pool
(not free; borrowed cached pages keep their reference, so they are not evictable) until
`release` (decode's ReleaseHandoff, the grace period, shutdown) asks the engine to free them
(`return_pages`, engine thread).

Where NIXL refuses the registration the sender falls back to the packed path (a NixlSender,
P-66) for the whole handoff, counted `nixl_page_registrations_failed`; so does a handoff whose
pages lie in more than MAX_REGIONS runs x layers, or whose registration's metadata would not fit
one chunk frame (`max_metadata_bytes`: decode takes a frame of at most its max_chunk_bytes and
a small overhead), counted `nixl_page_lease_fragmented` (measured: 6 ms and 180 KB of metadata
for 4096 regions, 0.16 ms and 3 KB for 64).

Invariants (besides KvSender's): every byte a frame names lies in the job's registered slots
and is not written until release (the engine writes other slots; cached pages are never
written); spans, chunk, hold and release hold one lock, so release never deregisters while a
frame is being built and hold never passes pages after release; the budget's take is given back
exactly once.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable

import numpy as np
import torch

from common.counters import Counters
from common.handoff.codec import chunk_payload
from common.handoff.crc import payload_crc32c
from common.handoff.layout import KvLayout
from common.handoff.nixl_agent import Registration
from common.handoff.page_pieces import slot_runs
from common.handoff.planes import NIXL
from common.kvpool.kv_cache import KvPool
from common.pb.kvhandoff.v1 import handoff_pb2
from prefill_svc.kv_sender import KvSender
from prefill_svc.nixl_sender import NixlPlane, NixlSender
from prefill_svc.oob_sender import reference_frame
from prefill_svc.page_lease import LeaseBudget
from prefill_svc.page_scrub import scrub_unwritten

MAX_REGIONS = 4096


class NixlPagesSender(KvSender):
    plane = NIXL
    pins_bytes = True

    def __init__(self, request_id: str, layout: KvLayout, num_tokens: int, nixl: NixlPlane,
                 pool: KvPool, budget: LeaseBudget, return_pages: Callable[[str], None],
                 counters: Counters, max_metadata_bytes: int) -> None:
        super().__init__(request_id)
        self.layout = layout
        self.num_tokens = num_tokens
        self.nixl = nixl
        self.pool = pool
        self.budget = budget
        self.pages = pool.allocator.pages_needed(num_tokens)  # taken from the budget
        self.return_pages = return_pages
        self.counters = counters
        self.max_metadata_bytes = max_metadata_bytes
        self.base = min(pool.k.data_ptr(), pool.v.data_ptr())
        self.span = max(pool.k.data_ptr() + pool.k.nbytes,
                        pool.v.data_ptr() + pool.v.nbytes) - self.base
        self.fallback: NixlSender | None = None  # NIXL refused the registration: packed
        self._reg: Registration | None = None
        self._breaks: list[int] = []  # token where each run of slots after the first starts
        self._first = True
        self.scrubbed_bytes = 0  # zeroed before the registration (P-68a)
        self._owner: str | None = None
        self._released = False
        self._budgeted = True
        self._lock = threading.Lock()
        self.peer_done = False

    def spans(self, page_table: torch.Tensor, token_start: int, token_end: int,
              chunk_tokens: int) -> list[tuple[int, int]]:
        with self._lock:
            if not self._released and self._reg is None and self.fallback is None:
                self._register(page_table.tolist(), token_end)
            if self.fallback is not None:
                return self.fallback.spans(page_table, token_start, token_end, chunk_tokens)
            out = []
            start = token_start
            while start < token_end:
                at = bisect.bisect_right(self._breaks, start)
                run_end = self._breaks[at] if at < len(self._breaks) else token_end
                count = min(chunk_tokens, run_end - start, token_end - start)
                out.append((start, count))
                start += count
            return out

    def _register(self, table: list[int], first_end: int) -> None:
        """Registers the slots of tokens [0, n) of every layer, K and V apart, after zeroing
        those not written yet (P-68a: prefill_svc.page_scrub; first_end: the end of the tokens
        of layer 0's first chunk, the only ones of the pass stored yet). Under the lock."""
        size = self.pool.page_size
        runs = slot_runs(table, size, 0, self.num_tokens)
        k = self.pool.k  # [L, P, S, Hkv, D], V alike
        row = k[0, 0, 0].numel() * k.element_size()  # bytes of one slot of one layer's K
        layer_bytes = k[0].nbytes
        regions = [(cache.data_ptr() + layer * layer_bytes + first * row, (end - first) * row)
                   for layer in range(self.layout.num_layers)
                   for cache in (self.pool.k, self.pool.v) for first, end in runs]
        tokens = np.cumsum([end - first for first, end in runs])
        self._breaks = [int(t) for t in tokens[:-1]]
        if len(regions) > MAX_REGIONS:
            self._fall_back("nixl_page_lease_fragmented")
            return
        scrubbed = scrub_unwritten(self.pool, self.record.request_id, table, self.num_tokens,
                                   first_end)
        if scrubbed is None:  # its pages are gone (not reached: spans run before the finish)
            self._fall_back("nixl_page_registrations_failed")
            return
        self.scrubbed_bytes = scrubbed
        try:
            reg = self.nixl.agent.register_regions(regions, share=True)
        except Exception:  # NIXL refused: this handoff goes packed, nothing held
            self._fall_back("nixl_page_registrations_failed")
            return
        if len(reg.metadata) > self.max_metadata_bytes:  # the first frame would be too large
            self.nixl.agent.deregister(reg)
            self._fall_back("nixl_page_lease_fragmented")
            return
        self._reg = reg
        self.nixl.pinned(+1)
        self.counters.add("nixl_page_leases")  # served from the pages: P-68's counter

    def _fall_back(self, counter: str) -> None:
        """The whole handoff takes the packed path (under the lock, before any frame)."""
        self.counters.add(counter)
        self._give_back_budget()
        self.fallback = NixlSender(self.record.request_id, self.layout, self.num_tokens,
                                   self.nixl)
        self.fallback.record = self.record

    def pack(self, ops, k_cache, v_cache, page_table, token_start, num_tokens):
        if self.fallback is not None:
            return self.fallback.pack(ops, k_cache, v_cache, page_table, token_start,
                                      num_tokens)
        return super().pack(ops, k_cache, v_cache, page_table, token_start, num_tokens)

    def chunk(self, request_id: str, sequence_number: int, layer: int, token_start: int,
              kv, nonce: bytes) -> bytes | None:
        if self.fallback is not None:
            return self.fallback.chunk(request_id, sequence_number, layer, token_start, kv,
                                       nonce)
        with self._lock:
            if self._released or self._reg is None or not self._sending():
                return None
            k, v, num_tokens = chunk_payload(kv)
            if len(k.pieces) != 1 or len(v.pieces) != 1:
                raise ValueError(f"chunk {sequence_number} spans {len(k.pieces)} runs of slots")
            k_at, v_at = k.pieces[0].ctypes.data, v.pieces[0].ctypes.data
            crc = payload_crc32c(k.pieces[0], v.pieces[0])
            first, self._first = self._first, False
            ref = handoff_pb2.KvRegionRef(
                k_offset=k_at - self.base, v_offset=v_at - self.base, length=len(k),
                nixl_address=self.base, nixl_buffer_size=self.span,
                nixl_buffer_metadata=self._reg.metadata if first else b"")
        self.nixl.emitted()
        return reference_frame(request_id, sequence_number, layer, token_start, num_tokens, crc,
                               nonce, ref)

    def hold(self, request_id: str) -> str | None:
        with self._lock:
            if self._released or self._reg is None:
                return None  # released already (or packed): free the pages now
            self._owner = f"nixl-lease-{id(self):x}:{request_id}"
        self.counters.add("nixl_lease_pages_held", self.pages)
        return self._owner

    def release(self, committed: bool, peer_done: bool = False) -> None:
        """Deregisters the handoff's slots, then hands its held pages back to the engine;
        peer_done: decode's ReleaseHandoff (else the grace period, shutdown or a failure)."""
        if self.fallback is not None:
            self.fallback.release(committed, peer_done)
            super().release(committed)
            return
        with self._lock:
            if self._released:
                return
            self._released = True
            self.peer_done = peer_done
            reg, self._reg = self._reg, None
            owner = self._owner
            if reg is not None:
                self.nixl.agent.deregister(reg)  # before the pages can go back
                self.nixl.pinned(-1)
        if owner is not None:
            self.return_pages(owner)
            self.counters.add("nixl_lease_pages_returned", self.pages)
            if not peer_done:
                self.counters.add("nixl_page_leases_expired")
        self._give_back_budget()
        super().release(committed)

    def _give_back_budget(self) -> None:
        if self._budgeted:
            self._budgeted = False
            self.budget.give_back(self.pages)
