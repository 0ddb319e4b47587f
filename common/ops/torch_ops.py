"""The torch reference backend: every op is its kernel file's ``*_reference`` function."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.kernels.decode_attention import decode_attention_reference
from common.kernels.pack_kv import pack_kv_reference, unpack_kv_reference
from common.kernels.paged_prefill_attention import paged_prefill_attention_reference
from common.kernels.prefill_attention import prefill_attention_reference
from common.kernels.rmsnorm import rmsnorm_reference
from common.kernels.rope import rope_reference
from common.kernels.store_kv import store_kv_reference


@dataclass(frozen=True)
class TorchOps:
    """Plain torch implementations; the oracle the Triton kernels are tested against."""

    name: str = "torch"

    def rmsnorm(self, x, weight, eps, residual):
        return rmsnorm_reference(x, weight, eps, residual)

    def rope(self, q, k, positions, cos_sin):
        rope_reference(q, k, positions, cos_sin)

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping):
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)

    def prefill_attention(self, q, k, v, cu_seqlens, max_seqlen, scale) -> torch.Tensor:
        return prefill_attention_reference(q, k, v, cu_seqlens, max_seqlen, scale)

    def paged_prefill_attention(self, q, k_cache, v_cache, page_table, cu_seqlens_q,
                                context_lens, max_seqlen_q, scale) -> torch.Tensor:
        return paged_prefill_attention_reference(q, k_cache, v_cache, page_table, cu_seqlens_q,
                                       context_lens, max_seqlen_q, scale)

    def decode_attention(self, q, k_cache, v_cache, page_table, seq_lens, scale) -> torch.Tensor:
        return decode_attention_reference(q, k_cache, v_cache, page_table, seq_lens, scale)

    def pack_kv(self, k_cache, v_cache, page_table, token_start, num_tokens) -> torch.Tensor:
        return pack_kv_reference(k_cache, v_cache, page_table, token_start, num_tokens)

    def unpack_kv(self, buffer, k_cache, v_cache, page_table, token_start):
        unpack_kv_reference(buffer, k_cache, v_cache, page_table, token_start)
