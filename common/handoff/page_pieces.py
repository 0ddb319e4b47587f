"""A chunk's K and V where they lie in a paged CPU pool: one uint8 view per run of contiguous
page slots, K and V apart, in token order. Both services move KV straight between these views
and the transport (prefill: into the frame, the region or the registered buffer; decode: from
the frame or its staging into the pages, or a region straight into them), so no pack or unpack
copy sits in between.

Invariants: views cover exactly tokens [token_start, token_end) of one layer of one request's
page table, in order; adjacent slots are merged into one view; nothing is copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.handoff.scattered import ScatteredBytes


def slot_runs(page_table: Sequence[int], page_size: int, token_start: int, token_end: int
              ) -> list[tuple[int, int]]:
    """[first slot, end slot) runs, in token order, of tokens [token_start, token_end)."""
    if token_end > len(page_table) * page_size:
        raise ValueError(f"tokens up to {token_end} do not fit {len(page_table)} pages")
    runs: list[tuple[int, int]] = []
    token = token_start
    while token < token_end:
        offset = token % page_size
        count = min(page_size - offset, token_end - token)
        first = int(page_table[token // page_size]) * page_size + offset
        if runs and runs[-1][1] == first:
            runs[-1] = (runs[-1][0], first + count)
        else:
            runs.append((first, first + count))
        token += count
    return runs


def cache_bytes(cache: torch.Tensor) -> np.ndarray:
    """A layer's cache [P, S, Hkv, D] (or all layers' [L, P, S, Hkv, D]), contiguous on the CPU
    -> its bytes as [P * S * row] (or [L, P * S * row]) uint8, the same memory."""
    assert cache.is_contiguous() and cache.device.type == "cpu", (cache.device, cache.stride())
    flat = cache.view(torch.uint8).numpy()
    return flat.reshape(-1) if cache.dim() == 4 else flat.reshape(cache.shape[0], -1)


@dataclass(frozen=True)
class KvPieces:
    """What `KvSender.pack` answers for a CPU pool: views of the chunk in the pages."""

    k: ScatteredBytes
    v: ScatteredBytes
    num_tokens: int


def kv_pieces(k_layer: np.ndarray, v_layer: np.ndarray, row: int, page_table: Sequence[int],
              page_size: int, token_start: int, token_end: int) -> KvPieces:
    """k_layer, v_layer: one layer's bytes (cache_bytes); row: bytes per token slot."""
    runs = slot_runs(page_table, page_size, token_start, token_end)
    return run_pieces(k_layer, v_layer, row, runs, token_end - token_start)


def run_pieces(k_layer: np.ndarray, v_layer: np.ndarray, row: int,
               runs: Sequence[tuple[int, int]], num_tokens: int) -> KvPieces:
    """kv_pieces of runs slot_runs already gave (the same for every layer of a token range)."""
    nbytes = num_tokens * row
    k, v = (ScatteredBytes(tuple(layer[a * row:b * row] for a, b in runs), nbytes)
            for layer in (k_layer, v_layer))
    return KvPieces(k, v, num_tokens)


def gather_into(dest: np.ndarray, data) -> None:
    """Fills dest (uint8, len(data) bytes) from data: a uint8 array or ScatteredBytes."""
    if not isinstance(data, ScatteredBytes):
        dest[:] = data
        return
    at = 0
    for piece in data.pieces:
        dest[at:at + piece.size] = piece
        at += piece.size
