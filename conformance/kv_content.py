"""The *content* of a handoff, checked without the model's weights (SPEC.md P-17).

A well-formed handoff is decoded into arrays, then either compared with a trusted reference
prefill's handoff of the same prompt (within a tolerance per dtype), or checked for layers that
are copies of each other (no transformer makes two layers' K, or two layers' V, equal: each
layer projects a different residual stream with different weights).

Closeness is elementwise, as in numpy.allclose with rtol = atol = tol:
|target - reference| <= tol * (1 + |reference|).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.pb.kvhandoff.v1 import common_pb2
from conformance.spec import KV_TOLERANCE
from conformance.wire import Received


@dataclass(frozen=True)
class HandoffKv:
    """K and V of a handoff as float32: k, v: [num_layers, token_count, num_kv_heads, head_dim]."""

    k: np.ndarray
    v: np.ndarray

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    def head(self, tokens: int) -> HandoffKv:
        """The KV of the first `tokens` positions."""
        return HandoffKv(self.k[:, :tokens], self.v[:, :tokens])


def _floats(data: bytes, dtype: int) -> np.ndarray:
    """Little-endian wire elements of `dtype` as float32 (bfloat16: the high half of a float32)."""
    if dtype == common_pb2.KV_DTYPE_FLOAT32:
        return np.frombuffer(data, dtype="<f4").astype(np.float32)
    if dtype == common_pb2.KV_DTYPE_FLOAT16:
        return np.frombuffer(data, dtype="<f2").astype(np.float32)
    if dtype == common_pb2.KV_DTYPE_BFLOAT16:
        return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    raise ValueError(f"unknown KV dtype {dtype}")


def handoff_kv(received: Received, layout: common_pb2.KvLayout, token_count: int) -> HandoffKv:
    """The KV of a handoff that passed the form checks (P-01..P-07: full, exact coverage)."""
    shape = (layout.num_layers, token_count, layout.num_kv_heads, layout.head_dim)
    k, v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    for c in received.chunks:
        rows = (c.token_end - c.token_start, layout.num_kv_heads, layout.head_dim)
        k[c.layer, c.token_start:c.token_end] = _floats(c.k, layout.dtype).reshape(rows)
        v[c.layer, c.token_start:c.token_end] = _floats(c.v, layout.dtype).reshape(rows)
    return HandoffKv(k, v)


def tolerance_for(dtype: int, override: float | None) -> float:
    return override if override is not None else KV_TOLERANCE[dtype]


def scaled_error(target: np.ndarray, reference: np.ndarray) -> float:
    """max |target - reference| / (1 + |reference|): the smallest tol the pair is close within
    (infinite when either holds a NaN or an infinity)."""
    if target.size == 0:
        return 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(target - reference) / (1.0 + np.abs(reference))
    return float("inf") if not np.isfinite(err).all() else float(err.max())


def compare_to_reference(target: HandoffKv, reference: HandoffKv, tol: float,
                         against: str = "the reference prefill's") -> list[str]:
    """Problems where the target's KV differ from the reference's by more than tol."""
    problems = []
    for layer in range(reference.num_layers):
        for name, a, b in (("K", target.k, reference.k), ("V", target.v, reference.v)):
            err = scaled_error(a[layer], b[layer])
            if err > tol:
                diff = np.abs(a[layer] - b[layer])
                token = int(np.unravel_index(np.nanargmax(diff), diff.shape)[0]) if np.isfinite(
                    diff).any() else 0
                problems.append(f"[P-17] layer {layer} {name} differs from {against} by "
                                f"{err:.3g} (tolerance {tol:g}; worst at token {token})")
    return problems


def copied_layers(kv: HandoffKv, tol: float) -> list[str]:
    """Problems for every pair of layers whose K, or whose V, are equal within tol."""
    problems = []
    for j in range(1, kv.num_layers):
        for i in range(j):
            for name, x in (("K", kv.k), ("V", kv.v)):
                if scaled_error(x[j], x[i]) <= tol:
                    problems.append(f"[P-17] layer {j} {name} equals layer {i}'s (within "
                                    f"{tol:g}): a copy, not that layer's KV")
    return problems


def max_abs_diff(target: HandoffKv, reference: HandoffKv) -> float:
    """The plain max |target - reference| over every layer, K and V (for reports)."""
    return float(max(np.abs(target.k - reference.k).max(), np.abs(target.v - reference.v).max()))
