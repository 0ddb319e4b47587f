"""The CPU backend's compiled (numba) RMSNorm and RoPE against the torch references: the
bfloat16 rounding against torch's on every tie, overflow and special pattern; RoPE bit for bit
in float32 and bfloat16 (the same float32 arithmetic, one rounding), on strided views with
guard bands; RMSNorm against the float32 reference and within a few ulp (float32) or all but a
few rounding-boundary values (bfloat16) of the in-place torch kernel; odd lengths, NaN and inf,
and every argument a raw-memory loop must not take refused."""

from __future__ import annotations

import pytest
import torch

import numba
import numpy as np

from common.kernels.numba_cpu import narrow_row
from common.kernels.rmsnorm import rmsnorm_reference
from common.kernels.rmsnorm_inplace import rmsnorm_inplace
from common.kernels.rmsnorm_numba import rmsnorm_numba
from common.kernels.rmsnorm_numba import supports as rmsnorm_supports
from common.kernels.rope import build_cos_sin, rope_reference
from common.kernels.rope_numba import rope_numba
from common.kernels.rope_numba import supports as rope_supports
from tests.helpers.rope_inputs import fused_qkv

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


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
    torch_out, _ = rmsnorm_inplace(x, weight, 1e-5, residual if with_residual else None)
    if dtype == F32:  # only the sum of squares is ordered differently: a few ulp at most
        torch.testing.assert_close(out, ref, rtol=8 * 2 ** -23, atol=1e-7)
        assert _ulps(out, torch_out) <= 8
    else:  # one rounding of the normalised row, one of the product (values up to ~|12|)
        torch.testing.assert_close(out.float(), ref, rtol=2 * 2 ** -8, atol=12 * 2 ** -8)
        assert (out != torch_out).float().mean() < 1e-3  # equal but at rounding boundaries


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in float32 ulps between two float32 tensors of finite values."""
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)  # ordered: a sign-magnitude flip
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int((ia - ib).abs().max())


@numba.njit
def _narrow_all(bits, out):
    narrow_row(bits, out)


def test_bfloat16_rounding_equals_torch_on_every_tie_and_special_value():
    """Every bfloat16 value's float32 neighbourhood: exact, just below, at and just above the
    halfway point, and the largest low half; inf, overflow to inf, -0.0, subnormals."""
    tops = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    bits = (tops[:, None] | lows[None, :]).ravel()
    out = np.empty(bits.shape[0], np.uint16)
    _narrow_all(bits.copy(), out)
    expected = torch.from_numpy(bits.view(np.float32)).to(BF16).view(torch.int16).numpy()
    got = out.view(np.int16)
    nan = np.isnan(bits.view(np.float32))
    assert (got[~nan] == expected[~nan]).all()
    assert np.isnan(torch.from_numpy(got[nan].copy()).view(BF16).float().numpy()).all()


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


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_rmsnorm_nan_in_the_residual_and_empty_inputs(dtype):
    x, residual = _rows(3, 32, dtype, 1), _rows(3, 32, dtype, 2)
    residual[1, 4] = float("nan")
    weight = torch.ones(32, dtype=dtype)
    out, summed = rmsnorm_numba(x, weight, 1e-5, residual)
    assert torch.isnan(summed[1, 4]) and torch.isnan(out[1]).all()
    assert torch.isfinite(out[[0, 2]]).all()
    empty, empty_sum = rmsnorm_numba(x[:0], weight, 1e-5, residual[:0])
    assert empty.shape == (0, 32) and empty_sum.shape == (0, 32)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize(("num_tokens", "group", "head_dim"),
                         [(1, 1, 64), (17, 4, 128), (1025, 2, 64), (8, 4, 32)])
@pytest.mark.parametrize("contiguous", [False, True])
def test_rope_equals_the_reference_bit_for_bit(num_tokens, group, head_dim, dtype,
                                               contiguous):
    """Strided: q and k are views of one fused qkv buffer, v must be left alone."""
    cos_sin = build_cos_sin(4096, head_dim, 10000.0, torch.device("cpu"))
    _, (q, k, v), positions = fused_qkv(num_tokens, group, head_dim, dtype)
    if contiguous:
        q, k = q.contiguous(), k.contiguous()
    v_before, q_ref, k_ref, q_before = v.clone(), q.clone(), k.clone(), q.clone()
    rope_numba(q, k, positions, cos_sin)
    rope_reference(q_ref, k_ref, positions, cos_sin)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(v, v_before)
    assert not torch.equal(q, q_before), "nothing was rotated"


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_rope_writes_only_its_rows(dtype):
    """q and k are every other head of a buffer (head stride 2 D) with sentinels between and
    around them: the rotated heads equal the reference's, the sentinels are untouched."""
    gen = torch.Generator().manual_seed(7)
    buffer = torch.full((9, 12, 32), 7.0, dtype=dtype)
    buffer[:, ::2] = (3 * torch.randn(9, 6, 32, generator=gen)).to(dtype)
    q, k = buffer[:, 0:8:2], buffer[:, 8:12:2]  # [9, 4, 32], [9, 2, 32], head stride 64
    positions = torch.randint(0, 64, (9,), generator=gen)
    cos_sin = build_cos_sin(64, 32, 10000.0, torch.device("cpu"))
    q_ref, k_ref = q.clone(), k.clone()
    rope_reference(q_ref, k_ref, positions, cos_sin)
    rope_numba(q, k, positions, cos_sin)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert (buffer[:, 1::2] == 7.0).all()


def test_overlapping_or_foreign_arguments_are_refused():
    cos_sin = build_cos_sin(64, 32, 10000.0, torch.device("cpu"))
    q, k = torch.randn(3, 4, 32), torch.randn(3, 2, 32)
    positions = torch.tensor([0, 1, 2])
    expanded = torch.randn(1, 2, 32).expand(3, 2, 32)  # every token one row: rotated 3 times
    assert not rope_supports(q, expanded, positions, cos_sin)
    assert not rope_supports(q, k, positions.int(), cos_sin)
    assert not rope_supports(q, k, positions, cos_sin.t().contiguous().t())
    assert not rope_supports(q, k.transpose(1, 2).contiguous().transpose(1, 2), positions,
                             cos_sin)
    for bad in ((q, expanded, positions, cos_sin), (q, k, positions.int(), cos_sin)):
        with pytest.raises(ValueError):
            rope_numba(*bad)
    with pytest.raises(ValueError):
        rope_numba(q, k[:2], positions, cos_sin)
    x, w = torch.randn(2, 8), torch.ones(8)
    assert not rmsnorm_supports(x, w, torch.ones(2, 8, dtype=BF16))
    with pytest.raises(ValueError):
        rmsnorm_numba(x, w, 1e-5, torch.ones(3, 8))
    with pytest.raises(ValueError):
        rmsnorm_numba(x, torch.ones(4), 1e-5)


def test_rope_position_outside_the_table_raises_and_writes_nothing():
    cos_sin = build_cos_sin(64, 32, 10000.0, torch.device("cpu"))
    _, (q, k, _), _ = fused_qkv(3, 2, 32, BF16)
    before = (q.clone(), k.clone())
    for bad in (64, -1):
        with pytest.raises(IndexError):
            rope_numba(q, k, torch.tensor([0, 5, bad]), cos_sin)
        assert torch.equal(q, before[0]) and torch.equal(k, before[1])


def test_rope_bfloat16_within_rounding_of_float32():
    cos_sin = build_cos_sin(4096, 64, 500000.0, torch.device("cpu"))
    _, (q, k, _), positions = fused_qkv(33, 4, 64, BF16, seed=3)
    q32, k32 = q.float(), k.float()
    rope_reference(q32, k32, positions, cos_sin)
    rope_numba(q, k, positions, cos_sin)
    torch.testing.assert_close(q.float(), q32, atol=1.6e-2 * 12, rtol=1.6e-2)
    torch.testing.assert_close(k.float(), k32, atol=1.6e-2 * 12, rtol=1.6e-2)


def test_only_float32_and_bfloat16_on_the_cpu():
    one = torch.ones(2, 2)
    assert rmsnorm_supports(one, torch.ones(2), None)
    assert rmsnorm_supports(one.to(BF16), torch.ones(2, dtype=BF16), None)
    assert not rmsnorm_supports(one.to(F16), torch.ones(2, dtype=F16), None)
    assert not rmsnorm_supports(one, torch.ones(2, dtype=BF16), None)
    table = build_cos_sin(4, 2, 10000.0, torch.device("cpu"))
    assert not rope_supports(torch.ones(2, 1, 2), torch.ones(2, 1, 2, dtype=BF16),
                             torch.arange(2), table)
    with pytest.raises(ValueError):
        rmsnorm_numba(torch.ones(2, 4, dtype=F16), torch.ones(4, dtype=F16), 1e-5)
