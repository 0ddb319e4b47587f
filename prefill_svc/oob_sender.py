"""What the out-of-band senders (shared memory, NIXL) share: one destination buffer per handoff,
filled chunk after chunk at a cursor, each chunk's frame a reference into it with the 1.1
checksums of the bytes there.

Where the destination is memory prefill can write in place (NIXL's registered buffer), `pack`
writes a chunk's K then V straight from the pool's pages into it (CPU caches: one copy, no
staging buffer); `chunk` checksums those bytes where they lie and returns the reference frame.
A `kv` that `pack` did not place (a GPU pool's host copy, a test's tensor) is copied in first.
A destination written by system call (a shared-memory region of its own: `pwrite` into tmpfs
measured 2x faster than stores through a fresh mapping, 19 vs 41 ms for 64 MiB) gets `_write` of
the chunk's views of the pages (one `pwritev` each for K and V: no pack copy at all); a pooled
region's file keeps its mapping, so it is packed into in place (prefill_svc.shm_sender).

Invariants (besides KvSender's): the destination is opened on the first chunk and closed only
by `release`; pack, chunk and release hold one lock, so release (event loop) never closes the
destination while the engine thread writes it; nothing is written or returned after release.
"""

from __future__ import annotations

import abc
import threading

import numpy as np
import torch

from common.handoff.binding import chunk_checksum, chunk_metadata
from common.handoff.codec import chunk_payload, frame_wire
from common.handoff.page_pieces import gather_into
from common.handoff.crc import payload_crc32c
from common.handoff.layout import KvLayout
from common.pb.kvhandoff.v1 import handoff_pb2
from prefill_svc.kv_sender import KvSender


def reference_frame(request_id: str, sequence_number: int, layer: int, token_start: int,
                    num_tokens: int, crc: int, nonce: bytes, ref: handoff_pb2.KvRegionRef
                    ) -> bytes:
    """The serialized chunk frame naming its K and V by ref, with the 1.1 checksums (crc: the
    CRC-32C of the bytes ref names, K then V)."""
    token_end = token_start + num_tokens
    meta = chunk_metadata(request_id, nonce, sequence_number, layer, token_start, token_end)
    return frame_wire(handoff_pb2.PrefillResponse(chunk=handoff_pb2.KvChunk(
        request_id=request_id, sequence_number=sequence_number, layer=layer,
        token_start=token_start, token_end=token_end, crc32c=crc, nonce=nonce,
        chunk_crc32c=chunk_checksum(crc, meta), ref=ref)))


class OutOfBandSender(KvSender):
    pins_bytes = True

    def __init__(self, request_id: str, layout: KvLayout, num_tokens: int) -> None:
        super().__init__(request_id)
        self.size = num_tokens * layout.kv_bytes_per_token
        self._dest: np.ndarray | None = None  # [>= size] uint8, the destination's bytes
        self._opened = False
        self._cursor = 0
        self._lock = threading.Lock()  # pack and chunk (engine thread) vs release (event loop)
        self._released = False
        self.peer_done = False  # released by the peer's ReleaseHandoff (it read all it will)

    @abc.abstractmethod
    def _open(self) -> np.ndarray | None:
        """Opens the destination (first chunk) -> its writable uint8 bytes (>= self.size) to pack
        into in place, or None: the packed bytes go through `_write`."""

    def _write(self, offset: int, data) -> None:
        """Stores data (uint8 array, or ScatteredBytes: the pages' views) at offset of a
        destination `_open` did not expose."""
        raise NotImplementedError

    @abc.abstractmethod
    def _reference(self, k_offset: int, v_offset: int, length: int, first: bool
                   ) -> handoff_pb2.KvRegionRef:
        """The reference to [k_offset, +length) and [v_offset, +length) of the destination;
        first: the first chunk of the handoff (it may carry what a peer needs to reach it)."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Gives the destination up (release); called once, under the lock, if it was opened.
        (A sender is never reopened: chunk and pack do nothing once released.)"""

    def pack(self, ops, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
             token_start: int, num_tokens: int) -> torch.Tensor:
        """CPU caches: tokens [token_start, +num_tokens) of one layer written at the cursor of
        the destination -> the [2, n, Hkv, D] view of them there; elsewhere KvSender's pack."""
        if k_cache.device.type != "cpu":
            return super().pack(ops, k_cache, v_cache, page_table, token_start, num_tokens)
        shape = (2, num_tokens, *k_cache.shape[2:])
        nbytes = 2 * num_tokens * k_cache[0, 0].numel() * k_cache.element_size()
        with self._lock:
            if self._released:  # chunk() answers None for it
                return super().pack(ops, k_cache, v_cache, page_table, token_start, num_tokens)
            dest = self._destination()
            if dest is None:
                return super().pack(ops, k_cache, v_cache, page_table, token_start, num_tokens)
            if self._cursor + nbytes > len(dest):
                raise ValueError(f"chunk of {nbytes} bytes past the end of the destination")
            pieces = self._cpu_pieces(k_cache, v_cache, page_table, token_start, num_tokens)
            half = self._cursor + nbytes // 2
            gather_into(dest[self._cursor:half], pieces.k)  # one copy per run of slots
            gather_into(dest[half:self._cursor + nbytes], pieces.v)
            window = torch.from_numpy(dest[self._cursor:self._cursor + nbytes])
            return window.view(k_cache.dtype).view(shape)  # [2, n, Hkv, D] in the destination

    def chunk(self, request_id: str, sequence_number: int, layer: int, token_start: int,
              kv, nonce: bytes) -> bytes | None:
        with self._lock:
            if self._released or not self._sending():
                return None
            first = self._cursor == 0
            dest = self._destination()
            k_offset = self._cursor
            placed = (dest is not None and isinstance(kv, torch.Tensor)
                      and kv.data_ptr() == dest.ctypes.data + k_offset)
            k, v, num_tokens = chunk_payload(kv)
            length = len(k)
            v_offset = k_offset + length
            if dest is None:
                self._write(k_offset, k)
                self._write(v_offset, v)
            else:
                if v_offset + length > len(dest):
                    raise ValueError(f"chunk of {2 * length} bytes past the destination's end")
                if not placed:  # not packed in place by pack: copy it in
                    gather_into(dest[k_offset:v_offset], k)
                    gather_into(dest[v_offset:v_offset + length], v)
                k, v = dest[k_offset:v_offset], dest[v_offset:v_offset + length]
            crc = payload_crc32c(k, v)
            self._cursor = v_offset + length
            ref = self._reference(k_offset, v_offset, length, first)
        return reference_frame(request_id, sequence_number, layer, token_start, num_tokens, crc,
                               nonce, ref)

    def _destination(self) -> np.ndarray | None:
        if not self._opened:
            self._dest = self._open()
            self._opened = True
        return self._dest

    def release(self, committed: bool, peer_done: bool = False) -> None:
        """peer_done: decode's ReleaseHandoff released it (so `_close` may keep what it can
        reuse: the peer has closed it); otherwise the grace period, shutdown or a failure."""
        with self._lock:
            self._released = True
            self.peer_done = peer_done
            if self._opened:
                self._dest, self._opened = None, False
                self._close()
        super().release(committed)
