"""The handoff's CPU copies between pages and transfer buffers, against the torch references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.kernels.pack_kv import (pack_kv_cpu, pack_kv_reference, unpack_kv_bytes_cpu,
                                    unpack_kv_reference)
from tests.kernels.conftest import build_paged_kv

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CPU = torch.device("cpu")

# (token_start, num_tokens, page_size, num_kv_heads, head_dim, dtype): copies only, so bf16 runs
# on the CPU too; starts inside a page, ranges ending mid-page, one-token pages.
CASES = [
    pytest.param(0, 1, 1, 2, 64, F32, id="s0-n1-ps1-f32"),
    pytest.param(3, 17, 16, 8, 128, F16, id="s3-n17-ps16-f16"),
    pytest.param(7, 70, 5, 8, 128, BF16, id="s7-n70-ps5-bf16"),
    pytest.param(16, 70, 16, 3, 64, BF16, id="s16-n70-ps16-h3-bf16"),
    pytest.param(0, 256, 16, 8, 128, BF16, id="s0-n256-ps16-bf16"),
]
PARAMS = ("start", "num_tokens", "page_size", "heads", "head_dim", "dtype")


def _wire(buffer: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """[2, n, Hkv, D] -> K and V as read-only uint8 arrays, as the wire codec hands them over."""
    flat = np.frombuffer(buffer.contiguous().view(torch.uint8).numpy().tobytes(), np.uint8)
    half = flat.size // 2
    return flat[:half], flat[half:]


@pytest.mark.parametrize(PARAMS, CASES)
def test_pack_cpu_matches_reference(start, num_tokens, page_size, heads, head_dim, dtype):
    width = (start + num_tokens + page_size - 1) // page_size + 4
    paged = build_paged_kv([start + num_tokens], page_size, heads, head_dim, dtype, CPU,
                           width=width)
    table = paged.page_table[0]
    out = torch.full((2, num_tokens, heads, head_dim), 7.0, dtype=dtype)
    got = pack_kv_cpu(paged.k_cache, paged.v_cache, table, start, out)
    assert got is out
    assert torch.equal(out, pack_kv_reference(paged.k_cache, paged.v_cache, table, start,
                                              num_tokens))
    assert not out.isnan().any(), "read a slot the request did not write"


@pytest.mark.parametrize(PARAMS, CASES)
def test_unpack_bytes_cpu_matches_reference(start, num_tokens, page_size, heads, head_dim,
                                            dtype):
    paged = build_paged_kv([start + num_tokens], page_size, heads, head_dim, dtype, CPU, seed=3)
    table = paged.page_table[0]
    buffer = torch.randn(2, num_tokens, heads, head_dim).to(dtype)
    k_ref, v_ref = paged.k_cache.clone(), paged.v_cache.clone()
    unpack_kv_reference(buffer, k_ref, v_ref, table, start)
    k, v = _wire(buffer)
    unpack_kv_bytes_cpu(k, v, paged.k_cache, paged.v_cache, table.numpy(), start, num_tokens)
    # every written slot as the reference, and nothing else touched (NaN slots stay NaN)
    torch.testing.assert_close(paged.k_cache, k_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(paged.v_cache, v_ref, atol=0, rtol=0, equal_nan=True)


def test_unpack_bytes_refuses_a_short_payload():
    paged = build_paged_kv([8], 4, 2, 8, F32, CPU)
    k, v = _wire(torch.zeros(2, 8, 2, 8))
    with pytest.raises(AssertionError):
        unpack_kv_bytes_cpu(k[:-4], v, paged.k_cache, paged.v_cache,
                            paged.page_table[0].numpy(), 0, 8)
