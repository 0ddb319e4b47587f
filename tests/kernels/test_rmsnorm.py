"""RMSNorm with the fused residual add vs the torch reference."""

from __future__ import annotations

import pytest
import torch

from common.kernels.rmsnorm import rmsnorm, rmsnorm_reference

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize(
    ("num_tokens", "hidden", "dtype"),
    [
        pytest.param(1, 64, F32, id="t1-h64-f32"),
        pytest.param(17, 128, F16, id="t17-h128-f16"),
        pytest.param(70, 4096, F32, id="t70-h4096-f32"),
        pytest.param(70, 1000, F16, id="t70-h1000-f16"),  # not a power of two: masked tail
        pytest.param(70, 4096, BF16, id="t70-h4096-bf16", marks=pytest.mark.gpu),
    ],
)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_matches_reference(device, num_tokens, hidden, dtype, with_residual):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    residual = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(device)
    residual = residual if with_residual else None
    x_before = x.clone()
    out, new_residual = rmsnorm(x, weight, 1e-6, residual)
    ref, ref_residual = rmsnorm_reference(x, weight, 1e-6, residual)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = {F32: 1e-5, F16: 2e-3, BF16: 1.6e-2}[dtype]  # ~one ulp of the rounded `normed`
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(x, x_before, atol=0, rtol=0)  # inputs untouched
    if with_residual:
        assert new_residual.dtype == x.dtype
        torch.testing.assert_close(new_residual, ref_residual, atol=0, rtol=0)  # x + r exactly
    else:
        assert new_residual is None


def test_fp32_weight_promotes(device):
    """fp16 x with an fp32 weight gives fp32 out, as ``weight * normed`` does in torch."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 256, generator=gen).half().to(device)
    weight = torch.rand(256, generator=gen).to(device)
    out, _ = rmsnorm(x, weight, 1e-5)
    ref, _ = rmsnorm_reference(x, weight, 1e-5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)  # `normed` is rounded to fp16
