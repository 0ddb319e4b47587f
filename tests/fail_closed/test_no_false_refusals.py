"""No false refusals: legitimate handoffs of mixed lengths (1 token, one page, several pages
plus a remainder), prefilled on one backend and checked by decode on another, are all accepted
by the content checks, with headroom under the tolerance (SPEC.md 7.4).

200 handoffs on the CPU in float32: torch -> torch (prefill attention vs decode attention, the
pair every deployment has), and torch -> Triton and Triton -> torch (interpreted, so fewer).
bf16 and fp16 with Triton on CUDA run when a GPU is present."""

from __future__ import annotations

import zlib

import pytest
import torch

from bench.verify_margin import measure

# pair -> handoffs; 200 in all on the CPU
CPU_PAIRS = {"torch:torch": 176, "torch:triton": 12, "triton:torch": 12}
MIN_MARGIN = 10.0  # the tolerance must sit well above what honest handoffs reach


@pytest.mark.parametrize("pair", sorted(CPU_PAIRS))
def test_legitimate_handoffs_are_accepted_cpu_float32(pair):
    margin = measure(pair, torch.float32, CPU_PAIRS[pair], seed=zlib.crc32(pair.encode()))
    # measure() raises HandoffRefused on the first refusal; here every handoff was accepted
    print(margin)
    assert margin.handoffs == CPU_PAIRS[pair]
    assert margin.layer0_margin >= MIN_MARGIN and margin.depth_margin >= MIN_MARGIN, margin


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pair", ["torch:triton", "triton:torch", "triton:triton"])
def test_legitimate_handoffs_are_accepted_gpu(pair, dtype):
    margin = measure(pair, dtype, 200, seed=7, device="cuda")
    print(margin)
    assert margin.layer0_margin >= 2.0 and margin.depth_margin >= 2.0, margin
