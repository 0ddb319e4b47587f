"""Inputs for the RoPE kernels' tests: q, k and v as views of one fused qkv buffer (the model's
layout), so a kernel must handle strided heads and leave v alone."""

from __future__ import annotations

import torch

NUM_KV_HEADS = 2


def fused_qkv(num_tokens: int, group: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """-> (qkv [T, Hq + 2 Hkv, D], (q, k, v) views of it, positions [T] int64 below 4096),
    Hq = NUM_KV_HEADS * group, values ~3 N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    hq = NUM_KV_HEADS * group
    qkv = (3 * torch.randn(num_tokens, hq + 2 * NUM_KV_HEADS, head_dim, generator=gen)).to(dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    return qkv, qkv.split([hq, NUM_KV_HEADS, NUM_KV_HEADS], dim=1), positions
