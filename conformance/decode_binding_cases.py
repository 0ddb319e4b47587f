"""The decode cases of protocol 1.1 (SPEC.md D-40..D-48): a handoff bound to its request, and
decode's checks of the KV content. Content cases send handoffs whose every id, nonce, digest and
checksum is right, as a tampering prefill would: only the content checks can refuse them."""

from __future__ import annotations

from conformance.decode_binding_edits import (
    INF,
    NAN,
    another_prompt,
    chunk_checksum_off,
    chunk_moved_from_layer_below,
    commit_checksum_off,
    decoy_kv,
    digest_of_other_prompt,
    forged_first_token,
    middle_chunk_nonce,
    middle_layer_range_stale,
    one_token_negated,
    other_nonce,
    placeholder_padded,
    poisoned_value,
    replay_with_nonce,
    swapped_chunk_labels,
    swapped_layers,
    with_digest,
    with_header_nonce,
    with_minor,
    zeroed_layer,
)
from conformance.decode_script import DecodeCase, refused, tokens

LONG_PROMPT = 40  # content cases: a few pages, so the depth check has positions to draw


def _case(case_id, rule, summary, script, reason, **kw) -> DecodeCase:
    return DecodeCase(case_id, rule, "MUST", summary, script, refused(reason), **kw)


def binding_cases() -> list[DecodeCase]:
    return [
        _case("nonce_header_other", "D-41", "header echoes another nonce",
              lambda i: with_header_nonce(i, other_nonce()), "NONCE_MISMATCH"),
        _case("nonce_header_missing", "D-41", "header without a nonce",
              lambda i: with_header_nonce(i, b""), "NONCE_MISMATCH"),
        _case("nonce_chunk_other", "D-41", "one middle chunk carries another handoff's nonce",
              middle_chunk_nonce, "NONCE_MISMATCH"),
        _case("replay_old_nonce", "D-41", "every frame carries an earlier handoff's nonce, "
              "checksums consistent", replay_with_nonce, "NONCE_MISMATCH"),
        _case("digest_other_prompt", "D-42", "header digest of another prompt",
              lambda i: with_digest(i, digest_of_other_prompt(i)), "PROMPT_DIGEST_MISMATCH"),
        _case("digest_missing", "D-42", "header without a prompt digest",
              lambda i: with_digest(i, b""), "PROMPT_DIGEST_MISMATCH"),
        _case("chunk_checksum_field", "D-43", "chunk_crc32c off by one bit",
              chunk_checksum_off, "FRAME_CHECKSUM_MISMATCH"),
        _case("chunk_labels_swapped", "D-43", "two equal chunks of layers 0 and 1 trade layer "
              "numbers (payload crc still right)", swapped_chunk_labels,
              "FRAME_CHECKSUM_MISMATCH"),
        _case("commit_checksum_field", "D-43", "commit_crc32c off by one bit",
              commit_checksum_off, "FRAME_CHECKSUM_MISMATCH"),
        _case("first_token_forged_unsealed", "D-43", "commit first token changed, its checksum "
              "as before", lambda i: forged_first_token(i, sealed=False),
              "FRAME_CHECKSUM_MISMATCH"),
        _case("version_1_0", "D-44", "header protocol 1.0 (unbound) from a decode that was not "
              "told to allow it", lambda i: with_minor(i, 0), "VERSION_UNSUPPORTED"),
        _case("kv_nan", "D-45", "one NaN in a middle layer, every checksum right",
              lambda i: poisoned_value(i, NAN), "KV_NOT_FINITE", prompt_tokens=LONG_PROMPT),
        _case("kv_inf", "D-45", "one +Inf in a middle layer, every checksum right",
              lambda i: poisoned_value(i, INF), "KV_NOT_FINITE", prompt_tokens=LONG_PROMPT),
        _case("kv_placeholder_padded", "D-46", "the KV of a placeholder padded to the prompt's "
              "length, every id and checksum right", decoy_kv, "KV_LAYER0_MISMATCH",
              prompt_tokens=LONG_PROMPT, decoy=placeholder_padded),
        _case("kv_other_prompt", "D-46", "the genuine KV of another prompt of the same length",
              decoy_kv, "KV_LAYER0_MISMATCH", prompt_tokens=LONG_PROMPT, decoy=another_prompt),
        _case("kv_layer0_zero", "D-46", "layer 0 all zeros, every checksum right",
              lambda i: zeroed_layer(i, 0), "KV_LAYER0_MISMATCH", prompt_tokens=LONG_PROMPT),
        _case("kv_layer0_v_zero", "D-46", "layer 0's V all zeros, its K genuine, every "
              "checksum right", lambda i: zeroed_layer(i, 0, "v"), "KV_LAYER0_MISMATCH",
              prompt_tokens=LONG_PROMPT),
        _case("kv_last_layer_zero", "D-47", "the last layer all zeros, every checksum right",
              lambda i: zeroed_layer(i, -1), "KV_DEPTH_MISMATCH", prompt_tokens=LONG_PROMPT),
        _case("kv_layers_swapped", "D-47", "layers 1 and 2 swapped whole, every checksum right",
              lambda i: swapped_layers(i, 1, 2), "KV_DEPTH_MISMATCH",
              prompt_tokens=LONG_PROMPT),
        _case("kv_deep_layers_of_other_prompt", "D-47", "layers 1.. of another prompt, layer 0 "
              "genuine", lambda i: decoy_kv(i, range(1, i.ref.num_layers)), "KV_DEPTH_MISMATCH",
              prompt_tokens=LONG_PROMPT, decoy=another_prompt),
        _case("kv_stale_range", "D-47", "a middle layer's second half holds stale KV of another "
              "prompt", middle_layer_range_stale, "KV_DEPTH_MISMATCH",
              prompt_tokens=LONG_PROMPT, decoy=another_prompt),
        _case("kv_one_token_middle_layer", "D-47", "one token's K and V negated in a middle "
              "layer (caught through attention at the last position)", one_token_negated,
              "KV_DEPTH_MISMATCH"),
        _case("kv_chunk_moved_layer", "D-47", "a middle layer's middle third holds the layer "
              "below's KV, relabelled", chunk_moved_from_layer_below, "KV_DEPTH_MISMATCH",
              prompt_tokens=LONG_PROMPT),
        DecodeCase("first_token_forged", "D-48", "MUST", "commit first token changed and its "
                   "checksum recomputed", lambda i: forged_first_token(i, sealed=True), tokens()),
    ]
