"""The CPU backend's SDPA chunked-prefill attention over paged KV vs the float32 reference.

Pools come from ``build_paged_kv`` (shuffled pages, NaN in every slot no sequence wrote), so a
read at or past ``context_len + chunk_len`` reaching the output shows as NaN.
"""

from __future__ import annotations

import pytest
import torch

from common.kernels.paged_prefill_attention import paged_prefill_attention_reference
from common.kernels.paged_prefill_attention_sdpa import paged_prefill_attention_sdpa

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
NUM_KV_HEADS = 2


def _check(make_paged_kv, tol, contexts, chunks, group, head_dim, dtype, page_size, **kw):
    lens = [c + n for c, n in zip(contexts, chunks, strict=True)]
    paged = make_paged_kv(lens, page_size, NUM_KV_HEADS, head_dim, dtype, **kw)
    gen = torch.Generator().manual_seed(1)
    total = sum(chunks)
    buf = torch.full((total + 20, NUM_KV_HEADS * group, head_dim), float("nan"), dtype=dtype)
    buf[:total] = torch.randn(total, NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor(contexts, dtype=torch.int32)
    args = (buf[:total], paged.k_cache, paged.v_cache, paged.page_table, cu, ctx, max(chunks),
            head_dim**-0.5)
    out = paged_prefill_attention_sdpa(*args)
    ref = paged_prefill_attention_reference(*args)
    assert out.shape == (total, NUM_KV_HEADS * group, head_dim) and out.dtype == dtype
    assert not out.isnan().any(), "a slot no sequence wrote reached the output"
    torch.testing.assert_close(out.float(), ref.float(), **tol(dtype))


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_odd_lengths_page_sizes_and_gqa(make_paged_kv, tol, page_size, group):
    """Chunks 1, 17 and 1025 over contexts 0, 21 (not page-aligned) and 32."""
    _check(make_paged_kv, tol, [0, 21, 32], [17, 1, 1025], group, 64, F32, page_size)


@pytest.mark.parametrize(
    ("contexts", "chunks"),
    [pytest.param([0], [1], id="one-token-no-context"),
     pytest.param([1], [1], id="one-token-one-context"),
     pytest.param([64, 5, 30], [33, 0, 16], id="empty-chunk")])
def test_lengths(make_paged_kv, tol, contexts, chunks):
    _check(make_paged_kv, tol, contexts, chunks, 4, 32, F32, 16)


def test_pages_reserved_past_the_chunk_are_not_read(make_paged_kv, tol):
    _check(make_paged_kv, tol, [20, 3], [5, 26], 2, 32, F32, 8, width=12, spare_pages=6)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_half_dtypes(make_paged_kv, tol, dtype):
    _check(make_paged_kv, tol, [0, 21, 32], [17, 1, 40], 4, 64, dtype, 16)
