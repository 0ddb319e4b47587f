"""The CPU backend's joint q/k RoPE vs the torch reference: bit for bit in every dtype (the same
float32 arithmetic), within bf16 rounding of the float32 reference on the same inputs, and only
q's and k's own elements written."""

from __future__ import annotations

import pytest
import torch

from common.kernels.rope import build_cos_sin, rope_reference
from common.kernels.rope_joint import rope_joint
from tests.helpers.rope_inputs import fused_qkv

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize(("num_tokens", "group", "head_dim"),
                         [(1, 1, 64), (17, 4, 128), (64, 2, 64), (1025, 2, 64), (8, 4, 32)])
def test_equals_the_reference_bit_for_bit(num_tokens, group, head_dim, dtype):
    """q and k are views of one fused qkv buffer (the model's layout); v must be left alone.
    Up to JOINT_MAX_TOKENS the joint path runs, 1025 tokens take the reference."""
    cos_sin = build_cos_sin(4096, head_dim, 10000.0, torch.device("cpu"))
    qkv, (q, k, v), positions = fused_qkv(num_tokens, group, head_dim, dtype)
    v_before, q_ref, k_ref, q_before = v.clone(), q.clone(), k.clone(), q.clone()
    rope_joint(q, k, positions, cos_sin)
    rope_reference(q_ref, k_ref, positions, cos_sin)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(v, v_before)
    assert not torch.equal(q, q_before), "nothing was rotated"


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_half_types_within_rounding_of_the_float32_reference(dtype):
    cos_sin = build_cos_sin(4096, 64, 500000.0, torch.device("cpu"))
    _, (q, k, _), positions = fused_qkv(33, 4, 64, dtype, seed=3)
    q32, k32 = q.float(), k.float()
    rope_reference(q32, k32, positions, cos_sin)
    rope_joint(q, k, positions, cos_sin)
    tol = {F16: 2e-3, BF16: 1.6e-2}[dtype]  # one rounding of values up to ~|12|
    torch.testing.assert_close(q.float(), q32, atol=tol * 12, rtol=tol)
    torch.testing.assert_close(k.float(), k32, atol=tol * 12, rtol=tol)


def test_rotates_positions_not_rows():
    """Row i at position p gets p's angle: position 0 is the identity, others move."""
    cos_sin = build_cos_sin(128, 64, 10000.0, torch.device("cpu"))
    q, k = torch.randn(3, 8, 64), torch.randn(3, 2, 64)
    q0, k0 = q.clone(), k.clone()
    rope_joint(q, k, torch.tensor([0, 5, 0]), cos_sin)
    assert torch.equal(q[0], q0[0]) and torch.equal(k[2], k0[2])
    assert not torch.allclose(q[1], q0[1]) and not torch.allclose(k[1], k0[1])
