"""In-place rotate-half RoPE vs the torch reference."""

from __future__ import annotations

import pytest
import torch

from common.kernels.rope import build_cos_sin, rope, rope_reference

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
NUM_KV_HEADS = 2


@pytest.mark.parametrize(
    ("num_tokens", "group", "head_dim", "dtype"),
    [
        pytest.param(1, 1, 64, F32, id="t1-g1-d64-f32"),
        pytest.param(17, 4, 128, F16, id="t17-g4-d128-f16"),
        pytest.param(70, 4, 64, F32, id="t70-g4-d64-f32"),
        pytest.param(70, 1, 128, F16, id="t70-g1-d128-f16"),
        pytest.param(70, 4, 128, BF16, id="t70-g4-d128-bf16", marks=pytest.mark.gpu),
    ],
)
def test_fused_qkv_in_place(device, num_tokens, group, head_dim, dtype):
    """q and k are views of one fused qkv buffer; v (the rest) must be left alone."""
    gen = torch.Generator().manual_seed(0)
    hq = NUM_KV_HEADS * group
    cos_sin = build_cos_sin(4096, head_dim, 10000.0, device)
    qkv = torch.randn(num_tokens, hq + 2 * NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    qkv = qkv.to(device)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(device)
    q, k, v = qkv.split([hq, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
    v_before = v.clone()
    q_ref, k_ref = q.clone(), k.clone()
    rope(q, k, positions, cos_sin)
    rope_reference(q_ref, k_ref, positions, cos_sin)
    tol = {F32: 1e-5, F16: 1e-3, BF16: 1e-2}[dtype]
    torch.testing.assert_close(q, q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(k, k_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(v, v_before, atol=0, rtol=0)


def test_contiguous_q_k(device):
    cos_sin = build_cos_sin(128, 64, 500000.0, device)
    q = torch.randn(9, 8, 64, device=device)
    k = torch.randn(9, 2, 64, device=device)
    positions = torch.arange(9, device=device) * 7
    q_ref, k_ref = q.clone(), k.clone()
    rope(q, k, positions, cos_sin)
    rope_reference(q_ref, k_ref, positions, cos_sin)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
