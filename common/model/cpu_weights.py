"""How the decoder's projection weights are stored on a CPU device, for MKL and oneDNN.

Invariants: the values are the checkpoint's, unchanged; only their storage order differs.
Measured on the bench checkpoint (hidden 512, one torch thread, weights cold in cache as in a
step, thread CPU time):
- column-major q/k/v/o and gate/up/down (F.linear then multiplies by a contiguous [K, N]
  matrix): one decode step 16.5 vs 17.7 ms at batch 1, 32.7 vs 33.9 ms at batch 8; prefill
  (>= 128 rows) gives bit-identical results at the same speed;
- the untied lm_head [vocab, H] prepacked by oneDNN (its only copy): 1.9 vs 3.2 ms at 8 rows,
  1.15 vs 1.2 at 1;
- with the cpu backend, a second copy of each layer weight prepacked by oneDNN, used for 2 to
  127 rows (decode batches): all the layers' linears 12.4 vs 15.5 ms at 8 rows, 13.2 vs 15.8 at
  2, but 9.8 vs 7.4 at 1 row (so one row keeps the column-major copy) and no faster from 128
  (prefill keeps it, and its bits). This copy doubles the layer weights' memory:
  `--kernels torch` does without it.
- bfloat16 (AMX / AVX512-BF16 CPUs), cpu backend: the oneDNN prepacked copy is the only copy
  and serves every row count: per weight [1536, 512], against F.linear on the column-major
  copy, 85 vs 188 us at 1 row, 85 vs 123 at 8, 206 vs 336 at 128, 1634 vs 2826 at 1024.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """weight: [N, K] -> the same values, [N, K], with strides (1, N)."""
    return weight.t().contiguous().t()


def lm_head_for(weight: torch.Tensor, tied: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """weight: [vocab, H] -> a function h: [T, H] -> logits [T, vocab] in weight's dtype.
    float32 on a CPU with oneDNN, untied: the weight prepacked once (the returned function
    holds the only copy, so the caller drops its own); otherwise F.linear on weight as it is
    (a tied weight is the embedding table, which must stay row-major for its lookups)."""
    if tied or not _packable(weight):
        return lambda h: F.linear(h, weight)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)  # opaque [V, H]

    def lm_head(h: torch.Tensor) -> torch.Tensor:
        # h: [T, H] -> [T, V]
        return torch.ops.mkldnn._linear_pointwise(h.contiguous(), packed, None, "none", [], "")
    return lm_head


PACKED_ROWS = range(2, 128)  # the row counts a float32 oneDNN copy serves (see above)
ALL_ROWS = range(0, 1 << 62)  # a bfloat16 oneDNN copy serves every row count
PACK_FOR_ROWS = 8  # the row count oneDNN tunes the packed layout for (a full 8-client batch)


def _packable(weight: torch.Tensor) -> bool:
    """A float32 weight on a CPU whose torch has oneDNN, or a bfloat16 one on a CPU whose oneDNN
    has bfloat16 kernels (AVX512-BF16 / AMX: elsewhere F.linear keeps the plain weight)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


def packed_rows(weight: torch.Tensor) -> range:
    """The row counts `packed_linear(weight, ...)` is used for; for bfloat16 all of them, so
    the caller can drop its own copy (see above)."""
    return ALL_ROWS if weight.dtype == torch.bfloat16 else PACKED_ROWS


def packed_linear(weight: torch.Tensor,
                  bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """weight: [N, K] float32 or bfloat16 on a CPU with oneDNN -> x: [M, K] -> [M, N] through
    a oneDNN prepacked copy, for the row counts `packed_rows(weight)`; else None."""
    if not _packable(weight):
        return None
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_FOR_ROWS)

    def linear(x: torch.Tensor) -> torch.Tensor:
        # x: [M, K] -> [M, N]
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return linear
