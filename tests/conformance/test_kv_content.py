"""The suite's KV content checks on arrays (no services): wire dtypes decode to the values sent,
the tolerance is elementwise and scaled, and copied layers are found."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.pb.kvhandoff.v1 import common_pb2
from conformance.kv_content import (
    HandoffKv,
    _floats,
    compare_to_reference,
    copied_layers,
    scaled_error,
)

WIRE = {common_pb2.KV_DTYPE_FLOAT32: torch.float32, common_pb2.KV_DTYPE_FLOAT16: torch.float16,
        common_pb2.KV_DTYPE_BFLOAT16: torch.bfloat16}


@pytest.mark.parametrize("dtype", sorted(WIRE))
def test_wire_elements_decode_to_the_values_sent(dtype):
    values = torch.randn(257, generator=torch.Generator().manual_seed(3)).to(WIRE[dtype])
    data = values.view(torch.uint8).numpy().tobytes()  # little-endian, as on the wire
    assert np.array_equal(_floats(data, dtype), values.float().numpy())


def _kv(layers: int, seed: int) -> HandoffKv:
    rng = np.random.default_rng(seed)
    shape = (layers, 9, 2, 4)
    return HandoffKv(rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32))


def test_scaled_error_is_relative_and_sees_non_finite_values():
    ref = np.array([0.0, 10.0], np.float32)
    assert scaled_error(ref + np.array([1e-3, 1.1e-2], np.float32), ref) == pytest.approx(1e-3)
    assert scaled_error(np.array([np.nan, 10.0], np.float32), ref) == float("inf")
    assert scaled_error(ref, ref) == 0.0


def test_reference_comparison_names_the_layer_over_tolerance():
    ref = _kv(3, 1)
    near = HandoffKv(ref.k + 1e-4, ref.v.copy())
    assert compare_to_reference(near, ref, 1e-3) == []
    far = HandoffKv(ref.k.copy(), ref.v.copy())
    far.v[2, 5] += 0.5
    problems = compare_to_reference(far, ref, 1e-3)
    assert len(problems) == 1 and "layer 2 V" in problems[0] and "token 5" in problems[0]


def test_copied_layers_are_found_and_distinct_layers_pass():
    kv = _kv(4, 2)
    assert copied_layers(kv, 1e-3) == []
    kv.k[3] = kv.k[0]
    problems = copied_layers(kv, 1e-3)
    assert problems == [("[P-17] layer 3 K equals layer 0's (within 0.001): a copy, not that "
                         "layer's KV")]
