"""Kernel-test setup: the Triton interpreter on machines without CUDA, and paged-KV builders.

TRITON_INTERPRET is set here, at the top, before anything in this directory runs a kernel. The
kernel modules jit their kernels on first use, so it does not matter whether ``triton`` or the
kernel modules were imported earlier (e.g. through ``TorchOps``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

HAS_CUDA = torch.cuda.is_available()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip ``@pytest.mark.gpu`` tests (bf16 kernels) without a CUDA device."""
    if item.get_closest_marker("gpu") is not None and not HAS_CUDA:
        pytest.skip("needs a CUDA device (bf16 is not reliable under the Triton interpreter)")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@dataclass
class PagedKV:
    k_cache: torch.Tensor  # [P, S, Hkv, D]; slots no sequence wrote hold NaN
    v_cache: torch.Tensor  # [P, S, Hkv, D]
    page_table: torch.Tensor  # [B, width] int32; entries past a sequence's pages -> a NaN page
    seq_lens: torch.Tensor  # [B] int32


def build_paged_kv(
    lens: list[int],
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    width: int | None = None,
    spare_pages: int = 3,
    seed: int = 0,
) -> PagedKV:
    """A shuffled page pool larger than needed, NaN everywhere no sequence wrote (including the
    tail of each last page), and page-table padding that points at a NaN page, so any read of a
    slot at or past a sequence's length, or of a page-table entry past its pages, shows as NaN."""
    gen = torch.Generator().manual_seed(seed)
    needed = [(n + page_size - 1) // page_size for n in lens]
    width = max(needed + [1]) if width is None else width
    assert width >= max(needed + [1])
    num_pages = sum(needed) + spare_pages
    k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    # Page 0 is never handed out and stays NaN: page-table padding points at it, and so does
    # any masked lane that computes its page as 0 and then loads anyway.
    perm = 1 + torch.randperm(num_pages - 1, generator=gen)
    nan_page = 0
    page_table = torch.full((len(lens), width), nan_page, dtype=torch.int32)
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    used = 0
    for b, (n, pages_needed) in enumerate(zip(lens, needed, strict=True)):
        pages = perm[used : used + pages_needed]
        used += pages_needed
        page_table[b, :pages_needed] = pages.to(torch.int32)
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        k_flat[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_flat[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return PagedKV(
        k_cache.to(device), v_cache.to(device), page_table.to(device), seq_lens.to(device)
    )


@pytest.fixture
def make_paged_kv(device):
    """Factory fixture: ``make_paged_kv(lens, page_size, Hkv, D, dtype, width=None, seed=0)``."""

    def make(lens, page_size, num_kv_heads, head_dim, dtype, **kwargs) -> PagedKV:
        return build_paged_kv(lens, page_size, num_kv_heads, head_dim, dtype, device, **kwargs)

    return make


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    return {
        torch.float32: {"atol": 1e-4, "rtol": 1e-4},
        torch.float16: {"atol": 5e-3, "rtol": 5e-3},
        torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
    }[dtype]


@pytest.fixture
def tol():
    """``tol(dtype)`` -> assert_close tolerances for attention outputs in that dtype."""
    return tolerances
