"""Our real prefill and decode pass every case of the conformance suite."""

from __future__ import annotations

import pytest

from tests.conformance.suite_process import PREFILL_FLAGS, run_decode_suite, run_prefill_suite
from tests.helpers.cluster import start_service

pytestmark = pytest.mark.slow


def test_prefill_passes_every_case(reference_prefill, tmp_path):
    """The KV content case compares our torch-ops prefill with our Triton-kernel prefill (the
    Triton interpreter on a CPU): two correct implementations, within the fp32 tolerance."""
    triton = start_service("prefill", tmp_path / "triton", [*PREFILL_FLAGS, "--kernels", "triton"])
    try:
        run = run_prefill_suite(reference_prefill.address, tmp_path,
                                ["--reference-prefill", triton.address])
    finally:
        triton.stop()
    assert run.returncode == 0, run.output
    assert run.outcomes and set(run.outcomes.values()) == {"pass"}, run.output
    assert {"reject_beyond_pool", "kv_matches_reference", "kv_layers_distinct",
            "kv_prefix_consistent", "reject_missing_version"} <= set(run.outcomes)


def test_decode_passes_every_case(reference_prefill, tmp_path):
    run = run_decode_suite(lambda flags: start_service("decode", tmp_path / "decode", flags),
                           reference_prefill.address, tmp_path, ["--stall-deadline", "5"])
    assert run.returncode == 0, run.output
    assert run.outcomes and set(run.outcomes.values()) == {"pass"}, run.output
    assert {"stall_past_deadline", "stall_reason_reported", "chunk_over_max",
            "frame_malformed", "prompt_over_window", "prompt_beyond_prefill_pool",
            "request_long_prompt", "cancel_after_refusal", "chunk_range_end_past_count",
            "good_one_token_edges", "model_fingerprint_empty"} <= set(run.outcomes)
