"""The CPU backend's compiled (numba) RMSNorm and RoPE against the float32 torch references:
RoPE bit for bit in float32 and bfloat16 (the same float32 arithmetic, one rounding), RMSNorm
within an ulp of float32 and bit for bit with the in-place torch kernel in bfloat16 on these
inputs; odd lengths, q/k as strided views of a fused buffer, NaN and inf rows kept as the
reference keeps them, and nothing written but the outputs."""

from __future__ import annotations

import pytest
import torch

from common.kernels.numba_rows import bits_view
from common.kernels.rmsnorm import rmsnorm_reference
from common.kernels.rmsnorm_inplace import rmsnorm_inplace
from common.kernels.rmsnorm_numba import rmsnorm_numba
from common.kernels.rmsnorm_numba import supports as rmsnorm_supports
from common.kernels.rope import build_cos_sin, rope_reference
from common.kernels.rope_numba import rope_numba
from common.kernels.rope_numba import supports as rope_supports

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
NUM_KV_HEADS = 2


def _rows(num_tokens, width, dtype, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(num_tokens, width, generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("num_tokens", [1, 17, 1025])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_against_the_float32_reference(num_tokens, dtype, with_residual):
    x, residual = _rows(num_tokens, 96, dtype, 1), _rows(num_tokens, 96, dtype, 2)
    weight = _rows(1, 96, dtype, 3, scale=1.0)[0]
    before = (x.clone(), residual.clone(), weight.clone())
    out, summed = rmsnorm_numba(x, weight, 1e-5, residual if with_residual else None)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])
    assert torch.equal(weight, before[2])
    if with_residual:  # the sum is the sum of the inputs in their dtype, exactly
        assert torch.equal(summed, x + residual)
    else:
        assert summed is None
    base = x + residual if with_residual else x  # the sum in x's dtype, then float32
    ref, _ = rmsnorm_reference(base.float(), weight.float(), 1e-5, None)
    if dtype == F32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
    else:  # one rounding of the normalised row, one of the product (values up to ~|12|)
        torch.testing.assert_close(out.float(), ref, rtol=2 * 2 ** -8, atol=12 * 2 ** -8)
        torch_out, _ = rmsnorm_inplace(x, weight, 1e-5, residual if with_residual else None)
        assert (out != torch_out).float().mean() < 1e-3  # the same roundings but for ties


def test_rmsnorm_nan_and_inf_rows_as_the_reference():
    x = _rows(4, 64, BF16, 5)
    x[1, 7], x[2, 9] = float("nan"), float("inf")
    weight = torch.ones(64, dtype=BF16)
    out, _ = rmsnorm_numba(x, weight, 1e-5)
    ref, _ = rmsnorm_inplace(x, weight, 1e-5)
    assert torch.isnan(out[1]).all() and torch.isnan(ref[1]).all()
    assert torch.equal(torch.isnan(out[2]), torch.isnan(ref[2]))
    assert torch.isfinite(out[[0, 3]]).all()
    torch.testing.assert_close(out[[0, 3]], ref[[0, 3]], rtol=0, atol=0)


def _fused_qkv(num_tokens, group, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hq = NUM_KV_HEADS * group
    qkv = (3 * torch.randn(num_tokens, hq + 2 * NUM_KV_HEADS, head_dim, generator=gen)).to(dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    return qkv.split([hq, NUM_KV_HEADS, NUM_KV_HEADS], dim=1), positions


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize(("num_tokens", "group", "head_dim"),
                         [(1, 1, 64), (17, 4, 128), (1025, 2, 64), (8, 4, 32)])
@pytest.mark.parametrize("contiguous", [False, True])
def test_rope_equals_the_reference_bit_for_bit(num_tokens, group, head_dim, dtype,
                                               contiguous):
    """Strided: q and k are views of one fused qkv buffer, v must be left alone."""
    cos_sin = build_cos_sin(4096, head_dim, 10000.0, torch.device("cpu"))
    (q, k, v), positions = _fused_qkv(num_tokens, group, head_dim, dtype)
    if contiguous:
        q, k = q.contiguous(), k.contiguous()
    v_before, q_ref, k_ref, q_before = v.clone(), q.clone(), k.clone(), q.clone()
    rope_numba(q, k, positions, cos_sin)
    rope_reference(q_ref, k_ref, positions, cos_sin)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(v, v_before)
    assert not torch.equal(q, q_before), "nothing was rotated"


def test_rope_position_outside_the_table_raises_and_writes_nothing():
    cos_sin = build_cos_sin(64, 32, 10000.0, torch.device("cpu"))
    (q, k, _), _ = _fused_qkv(3, 2, 32, BF16)
    before = (q.clone(), k.clone())
    for bad in (64, -1):
        with pytest.raises(IndexError):
            rope_numba(q, k, torch.tensor([0, 5, bad]), cos_sin)
        assert torch.equal(q, before[0]) and torch.equal(k, before[1])


def test_rope_bfloat16_within_rounding_of_float32():
    cos_sin = build_cos_sin(4096, 64, 500000.0, torch.device("cpu"))
    (q, k, _), positions = _fused_qkv(33, 4, 64, BF16, seed=3)
    q32, k32 = q.float(), k.float()
    rope_reference(q32, k32, positions, cos_sin)
    rope_numba(q, k, positions, cos_sin)
    torch.testing.assert_close(q.float(), q32, atol=1.6e-2 * 12, rtol=1.6e-2)
    torch.testing.assert_close(k.float(), k32, atol=1.6e-2 * 12, rtol=1.6e-2)


def test_only_float32_and_bfloat16_on_the_cpu():
    assert rmsnorm_supports(torch.ones(2, 2)) and rmsnorm_supports(torch.ones(2, 2, dtype=BF16))
    assert not rmsnorm_supports(torch.ones(2, 2, dtype=F16))
    assert not rope_supports(torch.ones(2, 1, 2), torch.ones(2, 1, 2, dtype=BF16))
    with pytest.raises(AssertionError):
        rmsnorm_numba(torch.ones(2, 4, dtype=F16), torch.ones(4, dtype=F16), 1e-5)


def test_bits_view_shares_memory():
    t = torch.tensor([1.0, -2.0], dtype=BF16)
    bits = bits_view(t)
    assert bits.dtype.itemsize == 2 and list(bits) == [0x3F80, 0xC000]
    bits[0] = 0x4040  # 3.0
    assert t[0].item() == 3.0
