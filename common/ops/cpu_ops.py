"""The CPU fast path: prefill attention through torch's fused scaled_dot_product_attention over
views or gathers of the pages (common/kernels/*_sdpa.py), float32 decode attention as one
compiled loop over the batch (numba, common/kernels/decode_attention_numba.py; half types keep
SDPA, whose bf16 kernel is the fast one on AMX CPUs), page stores by index_copy_, and RMSNorm
and RoPE as one compiled loop each (numba, common/kernels/*_numba.py) in float32 and bfloat16
(other dtypes: RoPE with q and k as one tensor, RMSNorm with its temporaries updated in
place). In a
decode step each torch op costs a few microseconds (the linears' weights evict the dispatcher's
working set), and in a prefill pass each of their temporaries is a pass over memory, so a
fused loop saves both. F.rms_norm measured no faster in a bf16 step (torch 2.13 composes it of
the same ops on the CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.kernels.decode_attention_numba import decode_attention_numba
from common.kernels.decode_attention_numba import supports as decode_attention_numba_supports
from common.kernels.decode_attention_sdpa import decode_attention_sdpa
from common.kernels.paged_prefill_attention_sdpa import paged_prefill_attention_sdpa
from common.kernels.prefill_attention_sdpa import prefill_attention_sdpa
from common.kernels.rmsnorm_inplace import rmsnorm_inplace
from common.kernels.rmsnorm_numba import rmsnorm_numba
from common.kernels.rmsnorm_numba import supports as rmsnorm_numba_supports
from common.kernels.rope_joint import rope_joint
from common.kernels.rope_numba import rope_numba
from common.kernels.rope_numba import supports as rope_numba_supports
from common.kernels.store_kv_index_copy import store_kv_index_copy
from common.ops.torch_ops import TorchOps


@dataclass(frozen=True)
class CpuOps(TorchOps):
    """TorchOps with every op but pack/unpack replaced; same signatures and semantics, tested
    against the float32 references (tests/kernels/test_*_sdpa.py, test_store_kv_index_copy.py,
    test_rope_joint.py, test_rmsnorm_inplace.py, test_numba_kernels.py,
    test_decode_attention_numba.py)."""

    name: str = "cpu"

    def rmsnorm(self, x, weight, eps, residual):
        if rmsnorm_numba_supports(x, weight, residual):
            return rmsnorm_numba(x, weight, eps, residual)
        return rmsnorm_inplace(x, weight, eps, residual)

    def rope(self, q, k, positions, cos_sin):
        if rope_numba_supports(q, k, positions, cos_sin):
            rope_numba(q, k, positions, cos_sin)
        else:
            rope_joint(q, k, positions, cos_sin)

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping):
        store_kv_index_copy(key, value, k_cache, v_cache, slot_mapping)

    def prefill_attention(self, q, k, v, cu_seqlens, max_seqlen, scale) -> torch.Tensor:
        return prefill_attention_sdpa(q, k, v, cu_seqlens, max_seqlen, scale)

    def paged_prefill_attention(self, q, k_cache, v_cache, page_table, cu_seqlens_q,
                                context_lens, max_seqlen_q, scale) -> torch.Tensor:
        return paged_prefill_attention_sdpa(q, k_cache, v_cache, page_table, cu_seqlens_q,
                                            context_lens, max_seqlen_q, scale)

    def decode_attention(self, q, k_cache, v_cache, page_table, seq_lens, scale) -> torch.Tensor:
        if decode_attention_numba_supports(q, k_cache, v_cache, page_table, seq_lens):
            return decode_attention_numba(q, k_cache, v_cache, page_table, seq_lens, scale)
        return decode_attention_sdpa(q, k_cache, v_cache, page_table, seq_lens, scale)
