"""The seam on prefill: how each chunk of a job's KV leaves for decode.

A `KvSender` is chosen per handoff from the plane decode named in its PrefillRequest (inline
gRPC bytes unless decode chose and prefill offers another). The engine thread calls `chunk` for
every (layer, token range) it packs and emits the frame it returns; the servicer calls `finish`
once the stream is over, whatever ended it.

Invariants every sender keeps:
- `chunk` returns one serialized PrefillResponse chunk frame carrying the 1.1 checksums, computed
  over exactly the bytes decode will read (inline: the frame's own bytes; out-of-band: the bytes
  in the region the frame names, written before the frame is returned);
- bytes a frame refers to stay unchanged and readable until `release` (decode's explicit
  release, or the stream's end plus the grace period); after `release` they are gone;
- `release` is idempotent and safe from any thread;
- the sender's `record` moves WAITING -> TRANSFERRING on the first chunk, then SUCCESS (released
  after a commit) or FAILED (released after anything else).
"""

from __future__ import annotations

import abc

import torch

from common.handoff.codec import chunk_wire
from common.handoff.page_pieces import KvPieces, cache_bytes, run_pieces, slot_runs
from common.handoff.transfer import TransferRecord, TransferState


class KvSender(abc.ABC):
    plane: str = ""
    pins_bytes = False  # True: the frames refer to bytes that outlive the stream until release

    def __init__(self, request_id: str = "") -> None:
        self.record = TransferRecord(request_id, self.plane)
        self._pages: list[int] | None = None  # the job's page table, read once (`_runs`)
        self._slot_runs: dict[tuple[int, int], list[tuple[int, int]]] = {}

    def _runs(self, page_table: torch.Tensor, page_size: int, token_start: int,
              token_end: int) -> list[tuple[int, int]]:
        """slot_runs of tokens [token_start, token_end), computed once per token range: a job's
        page table is fixed from its admission to its end (prefill_svc.engine: every page of
        its prompt is allocated before its first pass), and every layer's chunks of a range
        lie in the same slots."""
        if self._pages is None:
            self._pages = page_table.tolist()
        runs = self._slot_runs.get((token_start, token_end))
        if runs is None:
            runs = self._slot_runs[(token_start, token_end)] = slot_runs(
                self._pages, page_size, token_start, token_end)
        return runs

    def spans(self, page_table: torch.Tensor, token_start: int, token_end: int,
              chunk_tokens: int) -> list[tuple[int, int]]:
        """The (first token, tokens) of each chunk of tokens [token_start, token_end) of one
        layer, in order, at most chunk_tokens each (engine thread; page_table: the job's whole
        table, [pages] int32)."""
        return [(start, min(chunk_tokens, token_end - start))
                for start in range(token_start, token_end, chunk_tokens)]

    def hold(self, request_id: str) -> str | None:
        """The engine is done with the job (engine thread): the owner its pages pass to, kept
        out of the pool until the sender hands them back (its frames name those pages), or
        None: free them now."""
        return None

    def pack(self, ops, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
             token_start: int, num_tokens: int):
        """Tokens [token_start, token_start + num_tokens) of one layer's caches [P, S, Hkv, D]
        -> what `chunk` takes (engine thread). Caches in CPU memory: KvPieces, views of the
        pages themselves (nothing copied: `chunk` moves the bytes straight from the pages, and
        returns before the engine can free or rewrite them); elsewhere ops.pack_kv, then to the
        host ([2, n, Hkv, D] on the CPU)."""
        if k_cache.device.type != "cpu":
            return ops.pack_kv(k_cache, v_cache, page_table, token_start, num_tokens).cpu()
        return self._cpu_pieces(k_cache, v_cache, page_table, token_start, num_tokens)

    def _cpu_pieces(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, token_start: int, num_tokens: int) -> KvPieces:
        """Tokens [token_start, +num_tokens) of one layer's CPU caches as views of the pages."""
        row = k_cache[0, 0].numel() * k_cache.element_size()
        runs = self._runs(page_table, k_cache.shape[1], token_start, token_start + num_tokens)
        return run_pieces(cache_bytes(k_cache), cache_bytes(v_cache), row, runs, num_tokens)

    @abc.abstractmethod
    def chunk(self, request_id: str, sequence_number: int, layer: int, token_start: int,
              kv, nonce: bytes) -> bytes | None:
        """kv: what `pack` returned, or a [2, n, Hkv, D] CPU tensor -> the chunk frame to emit
        (engine thread); None once
        the handoff was released (its stream is gone: the engine drops the job, and never fails
        the other jobs of its batch because of it)."""

    def _sending(self) -> bool:
        """Marks the transfer TRANSFERRING; False when it already ended (released)."""
        if self.record.done:
            return False
        self.record.move(TransferState.TRANSFERRING)
        return True

    def release(self, committed: bool) -> None:
        """Frees what the frames refer to; committed: the handoff ended in an OK commit."""
        if not self.record.done:
            self.record.move(TransferState.SUCCESS if committed else TransferState.FAILED,
                             "" if committed else "not committed")


class InlineSender(KvSender):
    """K and V travel inside the chunk frames (today's path, every peer speaks it)."""

    plane = "inline"

    def chunk(self, request_id: str, sequence_number: int, layer: int, token_start: int,
              kv, nonce: bytes) -> bytes | None:
        if not self._sending():
            return None
        return chunk_wire(request_id, sequence_number, layer, token_start, kv, nonce)
