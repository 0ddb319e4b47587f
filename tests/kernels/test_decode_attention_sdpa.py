"""The CPU backend's batched-gather SDPA decode attention vs the float32 torch reference.

Pools come from ``build_paged_kv``: shuffled pages, NaN in every slot no sequence wrote (the
tail of each last page, spare pages) and page-table padding pointing at a NaN page, so a value
at or past a sequence's length reaching the output shows as NaN.
"""

from __future__ import annotations

import pytest
import torch

from common.kernels.decode_attention import decode_attention_reference
from common.kernels.decode_attention_sdpa import contiguous_rows, decode_attention_sdpa

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
NUM_KV_HEADS = 2


def _check(make_paged_kv, tol, lens, page_size, group, head_dim, dtype, **kwargs):
    paged = make_paged_kv(lens, page_size, NUM_KV_HEADS, head_dim, dtype, **kwargs)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    args = (q, paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens, head_dim**-0.5)
    out = decode_attention_sdpa(*args)
    ref = decode_attention_reference(*args)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not out.isnan().any(), "a slot no sequence wrote reached the output"
    torch.testing.assert_close(out.float(), ref.float(), **tol(dtype))


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_odd_lengths_page_sizes_and_gqa(make_paged_kv, tol, page_size, group):
    _check(make_paged_kv, tol, [1, 17, 1025], page_size, group, 64, F32)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_half_dtypes(make_paged_kv, tol, dtype):
    _check(make_paged_kv, tol, [3, 70, 1, 33], 16, 4, 64, dtype)


def test_wide_table_with_padding(make_paged_kv, tol):
    """A table wider than any sequence needs: padding entries point at a NaN page."""
    _check(make_paged_kv, tol, [3, 70, 1, 33, 16], 16, 4, 32, F32, width=12, spare_pages=6)


def test_strided_query(make_paged_kv, tol):
    """q as a view of a fused qkv row (the model's layout)."""
    paged = make_paged_kv([17, 70], 5, NUM_KV_HEADS, 64, F32)
    q = torch.randn(2, 8 + 2 * NUM_KV_HEADS, 64)[:, :8]
    args = (q, paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens, 0.125)
    torch.testing.assert_close(decode_attention_sdpa(*args), decode_attention_reference(*args),
                               **tol(F32))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_pages_in_one_run_are_read_through_a_view(tol, dtype):
    """Sequences whose pages are one ascending run (the allocator's usual hand-out) take the
    view path, one with reversed pages the gather path beside them; NaN in every slot no
    sequence wrote (each last page's tail, the pages between and after) never shows. bf16 is
    held to the float32 reference on the same (rounded) inputs."""
    lens, page_size, heads, dim = [1, 17, 1025, 40], 16, NUM_KV_HEADS, 64
    needed = [(n + page_size - 1) // page_size for n in lens]
    num_pages = 2 + sum(needed) + len(lens)
    k_cache = torch.full((num_pages, page_size, heads, dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    table = torch.zeros(len(lens), max(needed), dtype=torch.int32)
    next_page = 1
    for b, (n, pages) in enumerate(zip(lens, needed, strict=True)):
        run = torch.arange(next_page, next_page + pages)
        next_page += pages + 1  # one NaN page between sequences
        table[b, :pages] = (run.flip(0) if b == 3 else run).int()
        slots = (table[b, :pages].long()[:, None] * page_size + torch.arange(page_size))
        k_cache.view(-1, heads, dim)[slots.flatten()[:n]] = torch.randn(n, heads, dim)
        v_cache.view(-1, heads, dim)[slots.flatten()[:n]] = torch.randn(n, heads, dim)
    assert contiguous_rows(table, torch.tensor(needed)) == [True, True, True, False]
    q = torch.randn(len(lens), heads * 2, dim)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    out = decode_attention_sdpa(q, k_cache, v_cache, table, lens_t, 0.125)
    assert out.dtype == dtype
    assert not out.isnan().any(), "a slot no sequence wrote reached the output"
    ref = decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), table, lens_t,
                                     0.125)
    torch.testing.assert_close(out.float(), ref, **tol(dtype))


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_half_dtypes_against_the_float32_reference(make_paged_kv, tol, group, dtype):
    """Half types take the one-query-per-head layout (enable_gqa); each group size is held to
    the float32 reference on the same rounded inputs, q a strided view as the model passes."""
    paged = make_paged_kv([1, 17, 200, 33], 16, NUM_KV_HEADS, 64, dtype)
    heads = NUM_KV_HEADS * group
    q = torch.randn(4, heads + 2 * NUM_KV_HEADS, 64).to(dtype)[:, :heads]
    args = (paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens, 0.125)
    out = decode_attention_sdpa(q, *args)
    assert out.shape == q.shape and out.dtype == dtype
    assert not out.isnan().any(), "a slot no sequence wrote reached the output"
    ref = decode_attention_reference(q.float(), args[0].float(), args[1].float(), *args[2:])
    torch.testing.assert_close(out.float(), ref, **tol(dtype))


def test_contiguous_rows_looks_only_at_pages_in_use():
    table = torch.tensor([[4, 5, 6, 0], [4, 6, 7, 8], [9, 3, 3, 3], [2, 3, 9, 10]],
                         dtype=torch.int32)
    assert contiguous_rows(table, torch.tensor([3, 3, 1, 4])) == [True, False, True, False]


def test_empty_batch():
    cache = torch.zeros(2, 4, 1, 16)
    out = decode_attention_sdpa(torch.zeros(0, 2, 16), cache, cache,
                                torch.zeros(0, 1, dtype=torch.int32),
                                torch.zeros(0, dtype=torch.int32), 0.25)
    assert out.shape == (0, 2, 16)
