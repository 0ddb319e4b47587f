"""The one interface every model implements (the real decoders and the benchmarks' synthetic
model), and the batches it is called with.

Invariants of every implementation:
- it is stateless over requests: a forward reads and writes KV only through the caches it is
  given, and only at the slots named by the batch (``slot_mapping``, the page table);
- ``prefill`` stores a layer's KV before it calls ``on_layer_stored(layer)``, so a sender may
  pack that layer as soon as it is told, and stores layer ``l + 1`` only after
  ``on_layer_stored(l)`` returned (prefill_svc.page_scrub zeroes the later layers' slots from
  there: a model that stored ahead would have them zeroed and be refused by decode's checks);
- logits are float32 ``[B, vocab]``, one row per sequence of the batch, in batch order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from common.model.config import ModelConfig
from common.ops.interface import KernelOps


@dataclass(frozen=True)
class PrefillBatch:
    """A ragged batch of prompts, or of chunks of prompts. token_ids, positions (absolute),
    slot_mapping: [T]; cu_seqlens: [B + 1] int32 over the batch's tokens; max_seqlen: the
    longest of them.

    A chunk batch also gives page_table: [B, max_pages] int32 (each sequence's pages in token
    order) and context_lens: [B] int32 (tokens of sequence b already in its pages before this
    chunk); its queries then attend to those tokens as well as causally within the chunk, all
    read from the pages. Without a page table (both None) each sequence is a whole prompt and
    attends only to itself. positions of sequence b must start at context_lens[b].
    kv_stored False: the stores are skipped (every slot -1, e.g. measuring the activation peak
    without a pool), so nothing may be read back from the caches."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    context_lens: torch.Tensor | None = None
    page_table: torch.Tensor | None = None
    kv_stored: bool = True


@dataclass(frozen=True)
class DecodeBatch:
    """One new token per sequence. token_ids, positions, slot_mapping, seq_lens: [B] (seq_lens
    counts the new token); page_table: [B, max_pages] int32."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor


class CausalLM(Protocol):
    """What the engines, the verifier and the benchmarks need from a model."""

    config: ModelConfig
    ops: KernelOps
    device: torch.device
    dtype: torch.dtype

    def prefill(self, batch: PrefillBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                on_layer_stored: Callable[[int], None] | None = None) -> torch.Tensor:
        """Runs prompts (or chunks of prompts, see PrefillBatch), storing each layer's KV into
        the caches [L, P, S, Hkv, D]; -> float32 logits of each sequence's last token of the
        batch [B, vocab]."""
        ...

    def decode(self, batch: DecodeBatch, k_cache: torch.Tensor,
               v_cache: torch.Tensor) -> torch.Tensor:
        """One step for every sequence; -> float32 logits [B, vocab]."""
        ...

    def layer0_kv(self, token_ids: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer 0's K and V of the given tokens, as prefill stores them: ([T, Hkv, D],) * 2.
        Touches no cache (decode recomputes it to check a handoff's content)."""
        ...
