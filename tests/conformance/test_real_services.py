"""Our real prefill and decode pass every case of the conformance suite."""

from __future__ import annotations

import pytest

from common.config import PrefillConfig, ServiceConfig
from tests.conformance.suite_process import (
    PREFILL_FLAGS,
    run_decode_suite,
    run_prefill_suite,
    shared_memory_decode_flags,
)
from tests.helpers.cluster import start_service
from tests.helpers.polling import wait_until

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
    """Inline: every case passes but the shared-memory ones, which do not apply."""
    run = run_decode_suite(lambda flags: start_service("decode", tmp_path / "decode", flags),
                           reference_prefill.address, tmp_path, ["--stall-deadline", "5"])
    assert run.returncode == 0, run.output
    shared_memory = {case for case in run.outcomes if case.startswith("shm_")}
    assert len(shared_memory) >= 10, run.outcomes
    assert run.with_outcome("skip") == shared_memory, run.output
    assert run.with_outcome("pass") == set(run.outcomes) - shared_memory, run.output
    assert {"stall_past_deadline", "stall_reason_reported", "chunk_over_max",
            "frame_malformed", "prompt_over_window", "prompt_beyond_prefill_pool",
            "request_long_prompt", "cancel_after_refusal", "chunk_range_end_past_count",
            "good_one_token_edges", "model_fingerprint_empty"} <= set(run.outcomes)


def test_decode_passes_every_case_over_shared_memory(shared_memory_reference, tmp_path):
    """Decode on SHARED_MEMORY: every inline case, played with its chunks' bytes moved into a
    region of the fake's own, gives the same outcome, and every shared-memory case passes; the
    directory is left as it was."""
    reference, shm_dir = shared_memory_reference
    run = run_decode_suite(
        lambda flags: start_service("decode", tmp_path / "decode",
                                    [*flags, *shared_memory_decode_flags(shm_dir)]),
        reference.address, tmp_path, ["--stall-deadline", "5", "--shm-dir", str(shm_dir)])
    assert run.returncode == 0, run.output
    assert run.outcomes and set(run.outcomes.values()) == {"pass"}, run.output
    assert {"shm_passthrough", "shm_region_bytes_changed", "shm_region_symlink",
            "shm_region_group_readable", "kv_other_prompt", "chunk_over_max",
            "chunk_k_short"} <= set(run.outcomes)
    # the reference keeps the regions of handoffs nobody released for its grace period (P-63)
    grace = PrefillConfig(ServiceConfig()).release_grace_s
    wait_until(lambda: not list(shm_dir.iterdir()), grace + 10,
               lambda: f"regions left behind: {sorted(p.name for p in shm_dir.iterdir())}")
