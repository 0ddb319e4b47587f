"""The decode cases of the SHARED_MEMORY plane (SPEC.md 10.2): the reference's own regions, and
one middle chunk's bytes in a region of the fake's own that breaks one rule. They apply when the
decode under test asks for SHARED_MEMORY (start it with `--data-plane shared-memory` on the
reference prefill's `--shm-dir`, and pass the suite that directory as `--shm-dir`)."""

from __future__ import annotations

from conformance.decode_script import SHARED_MEMORY, DecodeCase, refused, tokens
from conformance.fake_prefill import passthrough
from conformance.plane_edits import (
    middle_in_missing_region,
    middle_in_region,
    middle_through_symlink,
    path_back_into,
)


def _case(case_id, rule, summary, script, expect) -> DecodeCase:
    return DecodeCase(case_id, rule, "MUST", summary, script, expect, planes=(SHARED_MEMORY,))


def shared_memory_cases() -> list[DecodeCase]:
    invalid = refused("REGION_INVALID")
    return [
        _case("shm_passthrough", "D-61", "the reference prefill's own frames and regions",
              passthrough, tokens()),
        _case("shm_own_region", "D-61", "the middle chunk's bytes in another good region (name, "
              "mode 0600, size, bytes all right)", middle_in_region, tokens()),
        _case("shm_v_after_gap", "D-61", "the middle chunk's V at its v_offset, 64 bytes "
              "after K ends (V does not follow K)", lambda i: middle_in_region(i, gap=64),
              tokens()),
        _case("shm_v_before_k", "D-61", "the middle chunk's V before its K in the region, 8 "
              "bytes apart", lambda i: middle_in_region(i, gap=8, v_first=True), tokens()),
        _case("shm_region_bytes_changed", "D-61", "one K byte in the referenced region differs "
              "from what the chunk's checksums cover",
              lambda i: middle_in_region(i, flip_byte=True), refused("CHECKSUM_MISMATCH")),
        _case("shm_region_missing", "D-63", "the middle chunk refers to a region that does not "
              "exist", middle_in_missing_region, invalid),
        _case("shm_region_short", "D-63", "the referenced region lacks the last byte of V",
              lambda i: middle_in_region(i, drop_last_byte=True), invalid),
        _case("shm_region_group_readable", "D-62", "the right bytes in a region of mode 0640",
              lambda i: middle_in_region(i, mode=0o640), invalid),
        _case("shm_region_symlink", "D-62", "the right bytes behind a symbolic link of a "
              "well-formed name", middle_through_symlink, invalid),
        _case("shm_region_name_form", "D-62", "the right bytes in a region not named "
              "kvh-<32 hex digits>", lambda i: middle_in_region(i, name="kvx-" + "0" * 32),
              invalid),
        _case("shm_region_path", "D-62", "the right bytes named by a path that leads back into "
              "the directory (../<dir>/kvh-...)",
              lambda i: middle_in_region(i, refer_as=path_back_into(i.regions.directory)),
              invalid),
        _case("shm_reference_and_bytes", "D-63", "the middle chunk carries its bytes inline and "
              "a reference to a region holding them", lambda i: middle_in_region(
                  i, keep_bytes=True), refused("REFERENCE_UNEXPECTED")),
    ]
