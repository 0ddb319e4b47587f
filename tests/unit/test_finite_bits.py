"""The finiteness check on a payload's bytes gives torch.isfinite's answer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decode_svc.finite_bits import all_finite_bytes

SPECIALS = [float("nan"), float("inf"), float("-inf"), -float("nan")]


def _bytes(t: torch.Tensor) -> np.ndarray:
    out = np.frombuffer(t.contiguous().view(torch.uint8).numpy().tobytes(), np.uint8)
    assert not out.flags.writeable  # as the wire codec hands it over
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_same_answer_as_isfinite(dtype):
    gen = torch.Generator().manual_seed(1)
    base = (torch.randn(4096, generator=gen) * 1e3).to(dtype)
    # the largest finite values and the smallest subnormals are finite
    info = torch.finfo(dtype)
    edges = torch.tensor([info.max, -info.max, info.tiny, -info.tiny, 0.0, -0.0]).to(dtype)
    assert all_finite_bytes(_bytes(torch.cat([base, edges])), dtype)
    assert torch.isfinite(torch.cat([base, edges])).all()
    for special in SPECIALS:
        for position in (0, 1234, 4095):
            bad = base.clone()
            bad[position] = special
            assert not torch.isfinite(bad).all()
            assert not all_finite_bytes(_bytes(bad), dtype), (special, position)


def test_every_bf16_bit_pattern_agrees():
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = torch.isfinite(patterns)
    for i in range(0, 1 << 16, 1024):  # one verdict per block of 1024 patterns
        block = patterns[i:i + 1024]
        assert all_finite_bytes(_bytes(block), torch.bfloat16) == bool(finite[i:i + 1024].all())


def test_empty_payload_is_finite():
    assert all_finite_bytes(np.empty(0, np.uint8), torch.bfloat16)


def test_a_non_finite_value_in_any_block_is_found(monkeypatch):
    """The check runs block by block: a NaN in the last, partial block counts too."""
    import decode_svc.finite_bits as finite_bits

    monkeypatch.setattr(finite_bits, "BLOCK_VALUES", 1000)
    values = torch.zeros(2500, dtype=torch.bfloat16)
    assert all_finite_bytes(_bytes(values), torch.bfloat16)
    for position in (0, 999, 1000, 2499):
        bad = values.clone()
        bad[position] = float("nan")
        assert not all_finite_bytes(_bytes(bad), torch.bfloat16), position


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16_bit_pattern_alone_agrees(dtype):
    """block_is_finite (signed max, unsigned max) on each pattern alone, and beside a finite
    neighbour of either sign, equals isfinite: the sign bit's two halves are both covered."""
    from decode_svc.finite_bits import block_is_finite

    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    finite = torch.isfinite(patterns.view(dtype)).tolist()
    raw = patterns.numpy().view(np.uint8).reshape(-1, 2)
    one = np.array([1.0, -1.0], dtype=np.float32)
    neighbours = torch.from_numpy(one).to(dtype).view(torch.int16).numpy().view(np.uint8)
    for i in range(1 << 16):
        assert block_is_finite(raw[i], dtype) is finite[i], hex(i)
        for n in range(2):
            pair = np.concatenate([raw[i], neighbours[2 * n:2 * n + 2]])
            assert block_is_finite(pair, dtype) is finite[i], (hex(i), n)


def test_float32_edge_patterns_agree():
    from decode_svc.finite_bits import block_is_finite

    edges = [0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x7FFFFFFF, 0xFF7FFFFF, 0xFF800000, 0xFFC00000,
             0xFFFFFFFF, 0x80000000, 0x00000000, 0x00000001, 0x80000001]
    gen = np.random.default_rng(3)
    for bits in [*edges, *gen.integers(0, 1 << 32, 2000, dtype=np.uint64).tolist()]:
        word = np.array([bits], dtype=np.uint32)
        expected = bool(np.isfinite(word.view(np.float32))[0])
        assert block_is_finite(word.view(np.uint8), torch.float32) is expected, hex(bits)
