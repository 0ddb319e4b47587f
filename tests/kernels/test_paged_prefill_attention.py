"""Chunked-prefill attention over paged KV: the Triton kernel vs the float32 torch reference, and
the reference vs dense causal attention over each sequence's whole (contiguous) KV.

Every pool comes from ``build_paged_kv``: shuffled pages, NaN in every slot no sequence wrote
(the tail of a last page, spare pages, page-table padding), so a read at or past
``context_len + chunk_len`` shows as NaN in the output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.kernels.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_reference,
)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
NUM_KV_HEADS = 2

# (group, head_dim, dtype): every pair of values meets at least once.
CASES = [
    pytest.param(1, 64, F32, id="g1-d64-f32"),
    pytest.param(4, 32, F32, id="g4-d32-f32"),
    pytest.param(4, 64, F16, id="g4-d64-f16"),
    pytest.param(1, 32, F16, id="g1-d32-f16"),
    pytest.param(4, 128, BF16, id="g4-d128-bf16", marks=pytest.mark.gpu),
]


def _inputs(make_paged_kv, contexts, chunks, group, head_dim, dtype, page_size, device, **kw):
    """-> (args for the op, PagedKV). Each sequence has context + chunk tokens written to its
    pages; q: [T, Hq, D] is a view of a NaN-padded buffer."""
    lens = [c + n for c, n in zip(contexts, chunks, strict=True)]
    paged = make_paged_kv(lens, page_size, NUM_KV_HEADS, head_dim, dtype, **kw)
    gen = torch.Generator().manual_seed(1)
    total = sum(chunks)
    buf = torch.full((total + 20, NUM_KV_HEADS * group, head_dim), float("nan"), dtype=dtype)
    buf[:total] = torch.randn(total, NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    q = buf.to(device)[:total]  # [T, Hq, D]
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    ctx = torch.tensor(contexts, dtype=torch.int32, device=device)
    args = (q, paged.k_cache, paged.v_cache, paged.page_table, cu, ctx, max(chunks + [0]),
            head_dim**-0.5)
    return args, paged


def _dense(q, k_cache, v_cache, page_table, cu, ctx, scale):
    """Dense causal attention per sequence over its KV gathered into one contiguous tensor:
    the chunk's queries are the last rows of a causal attention over all ctx + n keys."""
    page_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b, c in enumerate(ctx.tolist()):
        start, end = cu[b].item(), cu[b + 1].item()
        n = end - start
        total = c + n
        slots = [page_table[b, t // page_size].item() * page_size + t % page_size
                 for t in range(total)]
        k = k_cache.flatten(0, 1)[slots].float().cpu()  # [total, Hkv, D]
        v = v_cache.flatten(0, 1)[slots].float().cpu()
        mask = torch.ones(total, total, dtype=torch.bool).tril()[c:]  # [n, total]
        o = F.scaled_dot_product_attention(
            q[start:end].float().cpu().transpose(0, 1),  # [Hq, n, D]
            k.repeat_interleave(group, 1).transpose(0, 1),
            v.repeat_interleave(group, 1).transpose(0, 1),
            attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


def _check(make_paged_kv, tol, contexts, chunks, group, head_dim, dtype, page_size, device,
           **kw):
    args, _ = _inputs(make_paged_kv, contexts, chunks, group, head_dim, dtype, page_size, device,
                      **kw)
    out = paged_prefill_attention(*args)
    ref = paged_prefill_attention_reference(*args)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    assert not ref.isnan().any(), "the reference read an unwritten slot"
    assert not out.isnan().any(), "the kernel read an unwritten slot or page"
    torch.testing.assert_close(out.float(), ref.float(), **tol(dtype))
    q, kc, vc, pt, cu, ctx, _, scale = args
    dense = _dense(q, kc, vc, pt, cu, ctx, scale)
    torch.testing.assert_close(ref.float().cpu(), dense, **tol(dtype))


@pytest.mark.parametrize(("group", "head_dim", "dtype"), CASES)
def test_ragged_batch(make_paged_kv, tol, device, group, head_dim, dtype):
    """Contexts 0, not a multiple of the page size, and a multiple; chunks 1, 17, 40."""
    _check(make_paged_kv, tol, [0, 21, 32], [17, 1, 40], group, head_dim, dtype, 16, device)


@pytest.mark.parametrize(
    ("contexts", "chunks", "page_size"),
    [
        pytest.param([0], [1], 16, id="one-token-no-context"),
        pytest.param([1], [1], 16, id="one-token-one-context"),
        pytest.param([0], [70], 16, id="no-context-is-plain-prefill"),
        pytest.param([45], [17], 16, id="context-crosses-pages"),
        pytest.param([64, 5, 30], [33, 0, 16], 16, id="block-aligned-and-empty-chunk"),
        pytest.param([13, 3], [9, 30], 5, id="page-size-5"),
        pytest.param([7], [19], 1, id="page-size-1"),
    ],
)
def test_lengths(make_paged_kv, tol, device, contexts, chunks, page_size):
    _check(make_paged_kv, tol, contexts, chunks, 4, 32, F16, page_size, device)


def test_pages_reserved_past_the_chunk_are_not_read(make_paged_kv, tol, device):
    """Pages reserved for the rest of the prompt (a wide table whose padding is a NaN page) and
    NaN in the rest of the chunk's last page: none of it is read."""
    _check(make_paged_kv, tol, [20, 3], [5, 26], 2, 32, F32, 8, device, width=12, spare_pages=6)


def test_gqa_group_8(make_paged_kv, tol, device):
    _check(make_paged_kv, tol, [17, 0], [23, 9], 8, 32, F32, 16, device)


def test_max_seqlen_larger_than_needed(make_paged_kv, tol, device):
    """The grid is sized by max_seqlen_q; extra query blocks must do nothing."""
    args, _ = _inputs(make_paged_kv, [10, 4], [17, 3], 1, 32, F32, 16, device)
    out = paged_prefill_attention(*args[:6], 100, args[7])
    torch.testing.assert_close(out, paged_prefill_attention_reference(*args), **tol(F32))


def test_no_context_equals_plain_prefill(make_paged_kv, tol, device):
    """With every context 0 the op is causal self-attention of each chunk (prefill_attention)."""
    from common.kernels.prefill_attention import prefill_attention_reference

    args, paged = _inputs(make_paged_kv, [0, 0], [17, 30], 4, 32, F32, 16, device)
    q, kc, vc, pt, cu, _, max_q, scale = args
    ks, vs = [], []
    for b, n in enumerate([17, 30]):
        slots = [pt[b, t // 16].item() * 16 + t % 16 for t in range(n)]
        ks.append(kc.flatten(0, 1)[slots])
        vs.append(vc.flatten(0, 1)[slots])
    plain = prefill_attention_reference(q, torch.cat(ks), torch.cat(vs), cu, max_q, scale)
    torch.testing.assert_close(paged_prefill_attention(*args), plain, **tol(F32))
