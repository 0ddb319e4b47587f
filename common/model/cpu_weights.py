"""How the decoder's projection weights are stored on a CPU device, for MKL and oneDNN.

Invariants: the values are the checkpoint's, unchanged; only their storage order differs, and
the model keeps one copy of each weight (never a row-major one beside a packed one). Measured
on the bench checkpoint (hidden 512, one torch thread, weights cold in cache as in a step):
- column-major q/k/v/o and gate/up/down (F.linear then multiplies by a contiguous [K, N]
  matrix): one decode step 16.5 vs 17.7 ms at batch 1, 32.7 vs 33.9 ms at batch 8; prefill
  (>= 128 rows) gives bit-identical results at the same speed;
- the untied lm_head [vocab, H] prepacked by oneDNN: 1.9 vs 3.2 ms at 8 rows, 1.15 vs 1.2 at 1.
  (oneDNN-packed layer weights were faster at 8 rows, 27.7 vs 32.7 ms a step, but slower at 1,
  20.8 vs 16.5: not kept, since one copy serves every batch size.)
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
    if (tied or weight.device.type != "cpu" or weight.dtype != torch.float32
            or not torch.backends.mkldnn.is_available()):
        return lambda h: F.linear(h, weight)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)  # opaque [V, H]

    def lm_head(h: torch.Tensor) -> torch.Tensor:
        # h: [T, H] -> [T, V]
        return torch.ops.mkldnn._linear_pointwise(h.contiguous(), packed, None, "none", [], "")
    return lm_head
