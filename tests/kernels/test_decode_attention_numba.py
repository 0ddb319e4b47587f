"""The CPU backend's compiled (numba) decode attention vs the float32 torch reference.

Pools come from ``build_paged_kv``: shuffled pages, NaN in every slot no sequence wrote (the
tail of each last page, spare pages) and page-table padding pointing at a NaN page, so a value
at or past a sequence's length, or of an entry past its pages, reaching the output shows as
NaN. The loop reads raw memory, so every argument it must not take is refused before it runs.
"""

from __future__ import annotations

import pytest
import torch

from common.kernels.decode_attention import decode_attention_reference
from common.kernels.decode_attention_numba import decode_attention_numba, supports
from common.kernels.decode_attention_sdpa import decode_attention_sdpa
from common.ops.cpu_ops import CpuOps
from tests.kernels.conftest import build_paged_kv, tolerances

F32, BF16 = torch.float32, torch.bfloat16
CPU = torch.device("cpu")
NUM_KV_HEADS = 2


def _paged(lens, page_size=16, head_dim=64, dtype=F32, **kwargs):
    return build_paged_kv(lens, page_size, NUM_KV_HEADS, head_dim, dtype, CPU, **kwargs)


def _query(batch, heads, head_dim, dtype=F32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, head_dim, generator=gen).to(dtype)


def _check(lens, page_size, group, head_dim, **kwargs):
    paged = _paged(lens, page_size, head_dim, **kwargs)
    q = _query(len(lens), NUM_KV_HEADS * group, head_dim)
    args = (q, paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens, head_dim**-0.5)
    out = decode_attention_numba(*args)
    assert out.shape == q.shape and out.dtype == F32
    assert not out.isnan().any(), "a slot no sequence wrote reached the output"
    torch.testing.assert_close(out, decode_attention_reference(*args), **tolerances(F32))


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_odd_lengths_page_sizes_and_gqa(page_size, group):
    _check([1, 17, 1025], page_size, group, 64)


def test_wide_table_with_padding_and_a_small_head_dim():
    """A table wider than any sequence needs: padding entries point at a NaN page."""
    _check([3, 70, 1, 33, 16], 16, 4, 32, width=12, spare_pages=6)


def test_peaked_scores_stay_finite_and_match():
    """Large logits (scale 1): the softmax subtracts each head's maximum before exp."""
    paged = _paged([40, 300])
    q = 30.0 * _query(2, NUM_KV_HEADS * 2, 64)
    args = (q, paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens, 1.0)
    out = decode_attention_numba(*args)
    assert out.isfinite().all()
    torch.testing.assert_close(out, decode_attention_reference(*args), **tolerances(F32))


def test_strided_query():
    """q as a view of a fused qkv row (the model's layout), and a batch with a row stride."""
    paged = _paged([17, 70], 5)
    q = torch.randn(2, 8 + 2 * NUM_KV_HEADS, 64)[:, :8]
    assert not q.is_contiguous()
    args = (q, paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens, 0.125)
    torch.testing.assert_close(decode_attention_numba(*args), decode_attention_reference(*args),
                               **tolerances(F32))


def test_matches_the_sdpa_kernel_it_replaces():
    paged = _paged([1, 160, 1088, 33], 16)
    q = _query(4, NUM_KV_HEADS * 4, 64)
    args = (q, paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens, 0.125)
    torch.testing.assert_close(decode_attention_numba(*args), decode_attention_sdpa(*args),
                               **tolerances(F32))


def test_cpu_ops_take_it_for_float32_and_sdpa_for_bfloat16():
    ops = CpuOps()
    paged = _paged([5, 40])
    q = _query(2, NUM_KV_HEADS * 2, 64)
    args = (q, paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens, 0.125)
    assert torch.equal(ops.decode_attention(*args), decode_attention_numba(*args))
    half = _paged([5, 40], dtype=BF16)
    args = (q.to(BF16), half.k_cache, half.v_cache, half.page_table, half.seq_lens, 0.125)
    assert not supports(*args[:5])
    assert torch.equal(ops.decode_attention(*args), decode_attention_sdpa(*args))


def _args(paged, q):
    return [q, paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens, 0.125]


@pytest.mark.parametrize("bad_entry", [-1, 10_000])
def test_a_page_entry_outside_the_pool_is_refused_before_any_read(bad_entry):
    paged = _paged([20, 20])
    table = paged.page_table.clone()
    table[1, 1] = bad_entry  # the second sequence's second page, in use
    args = _args(paged, _query(2, 4, 64))
    args[3] = table
    with pytest.raises(IndexError, match="page entry in use outside"):
        decode_attention_numba(*args)


def test_an_entry_past_a_sequences_pages_is_never_looked_at():
    paged = _paged([20, 3], width=4)
    table = paged.page_table.clone()
    table[1, 1:] = 10_000  # past the one page a 3-token sequence uses
    args = _args(paged, _query(2, 4, 64))
    expected = decode_attention_reference(*args)
    args[3] = table
    torch.testing.assert_close(decode_attention_numba(*args), expected, **tolerances(F32))


@pytest.mark.parametrize("length", [0, -3, 17 * 16])
def test_a_length_below_one_or_past_the_table_is_refused(length):
    paged = _paged([20, 20])
    lens = paged.seq_lens.clone()
    lens[0] = length
    args = _args(paged, _query(2, 4, 64))
    args[4] = lens
    with pytest.raises(IndexError, match="sequence length"):
        decode_attention_numba(*args)


@pytest.mark.parametrize("change", ["half_q", "int64_table", "int64_lens", "strided_cache",
                                    "strided_head_dim", "heads", "head_dim", "batch"])
def test_arguments_a_raw_memory_loop_must_not_take_are_refused(change):
    paged = _paged([20, 20])
    args = _args(paged, _query(2, 4, 64))
    if change == "half_q":
        args[0] = args[0].to(BF16)
    elif change == "int64_table":
        args[3] = args[3].long()
    elif change == "int64_lens":
        args[4] = args[4].long()
    elif change == "strided_cache":
        args[1] = args[1].transpose(1, 2).contiguous().transpose(1, 2)
    elif change == "strided_head_dim":
        args[0] = torch.randn(2, 4, 128)[:, :, ::2]
    elif change == "heads":
        args[0] = _query(2, 3, 64)  # not a multiple of the KV heads
    elif change == "head_dim":
        args[0] = _query(2, 4, 32)
    else:
        args[0] = _query(3, 4, 64)
    with pytest.raises(ValueError):
        decode_attention_numba(*args)


def test_empty_batch():
    cache = torch.zeros(2, 4, 1, 16)
    out = decode_attention_numba(torch.zeros(0, 2, 16), cache, cache,
                                 torch.zeros(0, 1, dtype=torch.int32),
                                 torch.zeros(0, dtype=torch.int32), 0.25)
    assert out.shape == (0, 2, 16)
