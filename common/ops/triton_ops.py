"""The Triton backend: every op is its kernel file's Triton function.

On a CPU device the kernels run only through the Triton interpreter: set TRITON_INTERPRET=1
before the first op is called (the kernels are jitted on first use, so setting it after this
module is imported is fine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.kernels.decode_attention import decode_attention
from common.kernels.pack_kv import pack_kv, unpack_kv
from common.kernels.paged_prefill_attention import paged_prefill_attention
from common.kernels.prefill_attention import prefill_attention
from common.kernels.rmsnorm import rmsnorm
from common.kernels.rope import rope
from common.kernels.store_kv import store_kv


@dataclass(frozen=True)
class TritonOps:
    """Triton kernels with the same signatures and semantics as ``TorchOps``."""

    name: str = "triton"

    def rmsnorm(self, x, weight, eps, residual):
        return rmsnorm(x, weight, eps, residual)

    def rope(self, q, k, positions, cos_sin):
        rope(q, k, positions, cos_sin)

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping):
        store_kv(key, value, k_cache, v_cache, slot_mapping)

    def prefill_attention(self, q, k, v, cu_seqlens, max_seqlen, scale) -> torch.Tensor:
        return prefill_attention(q, k, v, cu_seqlens, max_seqlen, scale)

    def paged_prefill_attention(self, q, k_cache, v_cache, page_table, cu_seqlens_q,
                                context_lens, max_seqlen_q, scale) -> torch.Tensor:
        return paged_prefill_attention(q, k_cache, v_cache, page_table, cu_seqlens_q,
                                       context_lens, max_seqlen_q, scale)

    def decode_attention(self, q, k_cache, v_cache, page_table, seq_lens, scale) -> torch.Tensor:
        return decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale)

    def pack_kv(self, k_cache, v_cache, page_table, token_start, num_tokens) -> torch.Tensor:
        return pack_kv(k_cache, v_cache, page_table, token_start, num_tokens)

    def unpack_kv(self, buffer, k_cache, v_cache, page_table, token_start):
        unpack_kv(buffer, k_cache, v_cache, page_table, token_start)
