"""The suite fails each deliberately broken variant of our services (tests/conformance/broken),
on the cases of the rule that variant breaks, while the rest of the variant still works."""

from __future__ import annotations

import pytest

from tests.conformance.broken.process import start_variant
from tests.conformance.suite_process import (
    PREFILL_FLAGS,
    run_decode_suite,
    run_prefill_suite,
    shared_memory_decode_flags,
)

pytestmark = pytest.mark.slow

# variant -> cases that must fail (a subset of what fails), and a case that must still pass
DECODE_VARIANTS = {
    "decode_accepts_aborted": ({"chunks_after_aborted", "commit_aborted"}, "good_passthrough"),
    "decode_trusts_token_count": ({"token_count_placeholder", "token_count_short",
                                   "token_count_long"}, "good_passthrough"),
    "decode_skips_checksum": ({"checksum_payload", "checksum_field"}, "good_passthrough"),
    "decode_ignores_request_id": ({"request_id_header", "request_id_chunk", "request_id_commit"},
                                  "good_passthrough"),
    "decode_ignores_nonce": ({"nonce_header_other", "nonce_header_missing", "nonce_chunk_other",
                              "replay_old_nonce"}, "good_passthrough"),
    "decode_ignores_digest": ({"digest_other_prompt", "digest_missing"}, "good_passthrough"),
    "decode_skips_frame_checksums": ({"chunk_checksum_field", "chunk_labels_swapped",
                                      "commit_checksum_field", "first_token_forged_unsealed"},
                                     "good_passthrough"),
    "decode_accepts_protocol_1_0": ({"version_1_0"}, "good_passthrough"),
    "decode_ignores_reference_on_inline": ({"reference_on_inline"}, "good_passthrough"),
    "decode_skips_finite_check": ({"kv_nan", "kv_inf"}, "good_passthrough"),
    "decode_skips_layer0_check": ({"kv_placeholder_padded", "kv_other_prompt",
                                   "kv_layer0_zero"}, "good_passthrough"),
    "decode_skips_depth_check": ({"kv_last_layer_zero", "kv_layers_swapped",
                                  "kv_deep_layers_of_other_prompt", "kv_stale_range"},
                                 "good_passthrough"),
    "decode_streams_prefill_first_token": ({"first_token_forged"}, "good_passthrough"),
    "decode_trusts_cached_tokens": ({"cached_tokens_whole_prompt", "cached_tokens_part_page"},
                                    "good_passthrough"),
    "decode_truncates_long_prompt": ({"prompt_over_window", "prompt_beyond_prefill_pool"},
                                     "good_passthrough"),
    "decode_forwards_prompt_head": ({"request_long_prompt"}, "good_passthrough"),
    "decode_passes_salt_as_scope": ({"cache_scope_computed"}, "good_passthrough"),
    "decode_accepts_empty_fingerprint": ({"model_fingerprint_empty"}, "good_passthrough"),
    "decode_cancels_late": ({"cancel_after_refusal"}, "good_passthrough"),
    "decode_range_end_off_by_one": ({"chunk_range_end_past_count"}, "good_passthrough"),
    "decode_refuses_one_token_chunks": ({"good_one_token_edges"}, "good_passthrough"),
    "decode_accepts_major_0": ({"version_major_zero"}, "good_passthrough"),
    "decode_layer0_k_only": ({"kv_layer0_v_zero"}, "kv_layer0_zero"),
}
# on the SHARED_MEMORY plane (the decode and the suite on the reference's directory)
SHARED_MEMORY_DECODE_VARIANTS = {
    "decode_trusts_region_files": ({"shm_region_group_readable", "shm_region_symlink",
                                    "shm_region_name_form", "shm_region_path"},
                                   "shm_passthrough"),
    "decode_skips_checksum": ({"shm_region_bytes_changed", "checksum_payload"},
                              "shm_passthrough"),
    "decode_reads_v_after_k": ({"shm_v_after_gap", "shm_v_before_k"}, "shm_passthrough"),
}
PREFILL_VARIANTS = {
    "prefill_chunks_after_rejected": ({"reject_empty_prompt", "reject_out_of_vocab",
                                       "reject_over_window", "reject_beyond_pool"},
                                      "handoff_one_token"),
    "prefill_placeholder_over_length": ({"reject_over_window"}, "handoff_one_token"),
    "prefill_drops_a_chunk": ({"handoff_one_token", "handoff_small_chunks",
                               "concurrent_handoffs"}, "reject_over_window"),
    "prefill_forgets_nonce": ({"binding_long_prompt", "handoff_one_token"},
                              "handoff_1_0_request"),
    "prefill_digest_of_other_tokens": ({"binding_long_prompt", "handoff_one_token"},
                                       "handoff_1_0_request"),
    "prefill_accepts_short_nonce": ({"reject_short_nonce"}, "handoff_one_token"),
    "prefill_accepts_missing_version": ({"reject_missing_version"}, "handoff_one_token"),
    # the copied layers are caught with and without the reference
    "prefill_layer0_everywhere": ({"kv_matches_reference", "kv_layers_distinct"},
                                  "handoff_one_token"),
    # another prompt's KV: its layers differ as a real model's do, but it matches neither the
    # reference nor, without one, the KV of its own prompt's first half
    "prefill_kv_of_another_prompt": ({"kv_matches_reference", "kv_prefix_consistent"},
                                     "kv_layers_distinct"),
    "prefill_cache_keyed_by_position": ({"kv_cached_prefix_consistent"}, "kv_prefix_consistent"),
    "prefill_rejects_without_nonce": ({"reject_empty_prompt", "reject_short_nonce",
                                       "plane_not_offered"}, "handoff_one_token"),
    "prefill_shm_without_host_id": ({"plane_shm_no_host_id"}, "plane_shm_other_host"),
    "prefill_caches_unscoped": ({"cache_unscoped_untouched"}, "kv_cached_prefix_consistent"),
    # the lookup lends all four pages: nothing is left to compute, the repeat never answers
    "prefill_cache_covers_last_token": ({"kv_cached_whole_pages"}, "kv_cached_prefix_consistent"),
}


def _assert_caught(run, must_fail: set[str], still_passes: str) -> None:
    assert run.returncode == 1, run.output
    failed = run.with_outcome("fail")
    assert must_fail <= failed, f"not caught: {must_fail - failed}\n{run.output}"
    assert run.outcomes.get(still_passes) == "pass", run.output


@pytest.mark.parametrize("variant", sorted(DECODE_VARIANTS))
def test_suite_fails_broken_decode(variant, reference_prefill, tmp_path):
    must_fail, still_passes = DECODE_VARIANTS[variant]
    run = run_decode_suite(
        lambda flags: start_variant(variant, "decode", tmp_path / "decode", flags),
        reference_prefill.address, tmp_path, ["--skip", "stall_*"])
    _assert_caught(run, must_fail, still_passes)


@pytest.mark.parametrize("variant", sorted(SHARED_MEMORY_DECODE_VARIANTS))
def test_suite_fails_broken_decode_over_shared_memory(variant, shared_memory_reference,
                                                      tmp_path):
    must_fail, still_passes = SHARED_MEMORY_DECODE_VARIANTS[variant]
    reference, shm_dir = shared_memory_reference
    run = run_decode_suite(
        lambda flags: start_variant(variant, "decode", tmp_path / "decode",
                                    [*flags, *shared_memory_decode_flags(shm_dir)]),
        reference.address, tmp_path, ["--only", "shm_*,checksum_payload", "--shm-dir",
                                      str(shm_dir)])
    _assert_caught(run, must_fail, still_passes)


@pytest.mark.parametrize("variant", sorted(PREFILL_VARIANTS))
def test_suite_fails_broken_prefill(variant, reference_prefill, tmp_path):
    must_fail, still_passes = PREFILL_VARIANTS[variant]
    prefill = start_variant(variant, "prefill", tmp_path / "prefill", PREFILL_FLAGS)
    try:
        run = run_prefill_suite(prefill.address, tmp_path,
                                ["--reference-prefill", reference_prefill.address])
    finally:
        prefill.stop()
    _assert_caught(run, must_fail, still_passes)
