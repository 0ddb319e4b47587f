"""The CPU backend's RMSNorm vs the torch reference: bit for bit in every dtype (the same ops),
within bf16 rounding of the float32 reference, and no input tensor written."""

from __future__ import annotations

import pytest
import torch

from common.kernels.rmsnorm import rmsnorm_reference
from common.kernels.rmsnorm_inplace import rmsnorm_inplace

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _inputs(num_tokens, hidden, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (4 * torch.randn(num_tokens, hidden, generator=gen)).to(dtype)
    residual = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize(("num_tokens", "hidden"), [(1, 512), (17, 64), (1025, 512), (8, 100)])
def test_equals_the_reference_bit_for_bit(num_tokens, hidden, dtype, with_residual):
    x, residual, weight = _inputs(num_tokens, hidden, dtype)
    before = [t.clone() for t in (x, residual, weight)]
    res = residual if with_residual else None
    out, new_res = rmsnorm_inplace(x, weight, 1e-5, res)
    ref, ref_res = rmsnorm_reference(x, weight, 1e-5, res)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    assert (new_res is None) == (not with_residual)
    if with_residual:
        assert torch.equal(new_res, ref_res)
    for t, b in zip((x, residual, weight), before, strict=True):
        assert torch.equal(t, b), "an input was written"


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_half_types_within_rounding_of_the_float32_reference(dtype):
    x, residual, weight = _inputs(33, 512, dtype, seed=2)
    out, _ = rmsnorm_inplace(x, weight, 1e-6, residual)
    ref, _ = rmsnorm_reference(x.float(), weight.float(), 1e-6, residual.float())
    # the sum rounded in x's dtype, the normed value and the product once more each
    tol = {F16: 3e-3, BF16: 2.4e-2}[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_normalizes():
    """Each row comes out with unit RMS (weight 1), whatever its scale."""
    x = torch.randn(4, 256) * torch.tensor([[1e-2], [1.0], [10.0], [1e3]])
    out, _ = rmsnorm_inplace(x, torch.ones(256), 1e-12, None)  # eps far below 1e-4
    torch.testing.assert_close(out.pow(2).mean(dim=-1), torch.ones(4), atol=1e-5, rtol=1e-5)
