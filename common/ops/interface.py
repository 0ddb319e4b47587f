"""The one interface through which the model and the handoff touch KV pages.

Layouts shared by every backend:
- a layer's page pool is ``k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]``;
  slot ``s`` is page ``s // page_size``, offset ``s % page_size``;
- a request's page table is an int32 row of page ids, in token order;
- ragged prompt batches are flattened to ``[total_tokens, heads, head_dim]`` with
  ``cu_seqlens: [batch + 1]`` int32 prefix sums of the lengths.

Invariants every implementation keeps:
- no lane reads a slot at or past its sequence's real length (``seq_lens`` / ``num_tokens`` /
  ``context_lens + chunk length``);
- no lane writes a slot that is not named by ``slot_mapping`` or by the page table;
- the torch reference and the Triton kernel of one op agree within fp tolerance.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KernelOps(Protocol):
    """Ops with one signature per op; ``TorchOps`` is the reference, ``TritonOps`` the fast path."""

    name: str

    def rmsnorm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x, residual: [T, H]. With a residual, x + residual is normed and also returned."""
        ...

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> None:
        """In place, rotate-half style. q: [T, Hq, D], k: [T, Hkv, D], positions: [T] int64,
        cos_sin: [max_positions, D] float32 (cos in the first D/2 columns, sin in the last)."""
        ...

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """key, value: [T, Hkv, D] written to slots slot_mapping: [T] int64; a slot of -1 is
        skipped."""
        ...

    def prefill_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention within each sequence. q: [T, Hq, D], k, v: [T, Hkv, D] -> [T, Hq, D]."""
        ...

    def paged_prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        context_lens: torch.Tensor,
        max_seqlen_q: int,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of a chunk of each prompt over that prompt's pages (chunked
        prefill). q: [T, Hq, D] ragged by cu_seqlens_q: [B + 1] int32; caches: one layer's pool
        [P, S, Hkv, D]; page_table: [B, max_pages] int32; context_lens: [B] int32, the tokens
        of sequence b already in its pages before this chunk -> [T, Hq, D].

        Query i of sequence b sits at position context_lens[b] + i and attends to keys
        [0, context_lens[b] + i], all read from the pages: the chunk's own K/V must be stored
        before the call. No slot at or past context_lens[b] + chunk_len_b is read."""
        ...

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One query per sequence over its pages. q: [B, Hq, D], page_table: [B, max_pages] int32,
        seq_lens: [B] int32 (>= 1) -> [B, Hq, D]."""
        ...

    def pack_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        token_start: int,
        num_tokens: int,
    ) -> torch.Tensor:
        """Gather tokens [token_start, token_start + num_tokens) of one request, page_table:
        [num_pages] int32, into a new contiguous buffer [2, num_tokens, Hkv, D] (K then V)."""
        ...

    def unpack_kv(
        self,
        buffer: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        token_start: int,
    ) -> None:
        """Scatter buffer [2, n, Hkv, D] into tokens [token_start, token_start + n) of the
        request."""
        ...
