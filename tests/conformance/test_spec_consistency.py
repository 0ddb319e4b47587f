"""SPEC.md, the suite's tables and our services' reason codes say the same thing, and every
rule a case names exists in SPEC.md."""

from __future__ import annotations

import re
from pathlib import Path

from common.handoff.reasons import PLANE_REFUSAL_CODES, REFUSAL_CODES, REJECTION_CODES
from conformance.decode_cases import decode_cases
from conformance.decode_suite import suite_cases
from conformance.prefill_suite import prefill_cases
from conformance.spec import PLANE_REFUSAL_STATUS, REFUSAL_STATUS, REJECTION_STATUS

SPEC = (Path(__file__).resolve().parents[2] / "protos" / "kvhandoff" / "v1" / "SPEC.md").read_text()
ROW = re.compile(r"^\| ([A-Z][A-Z0-9_]+) \| ([^|]+) \| ([^|]+) \|$", re.MULTILINE)


def _table(heading: str) -> dict[str, tuple[str, str]]:
    section = SPEC.split(heading, 1)[1].split("\n### ", 1)[0]
    return {m[1]: (m[2].strip(), m[3].strip()) for m in ROW.finditer(section)}


def test_suite_tables_match_our_services():
    assert REFUSAL_STATUS == REFUSAL_CODES
    assert REJECTION_STATUS == REJECTION_CODES
    assert PLANE_REFUSAL_STATUS == PLANE_REFUSAL_CODES


def test_spec_tables_match_the_suite():
    refusals = _table("### 7.1")
    assert set(refusals) == set(REFUSAL_STATUS)
    for reason, code in REFUSAL_STATUS.items():
        if reason != "PEER_REJECTED":  # its status comes from the rejection table
            assert refusals[reason][0] == code.name, reason
    planes = _table("### 10.3")
    assert {r: s for r, (s, _) in planes.items()} == {
        r: c.name for r, c in PLANE_REFUSAL_STATUS.items()}
    rejections = _table("### 7.2")
    assert {r: s for r, (s, _) in rejections.items()} == {
        r: c.name for r, c in REJECTION_STATUS.items()}


def _rule_ids(rule: str) -> list[str]:
    return [part.strip() for part in re.split(r"\.\.|,", rule)]


def test_every_case_names_a_rule_of_the_spec():
    rules = set(re.findall(r"\*\*([GPD]-\d\d)\*\*", SPEC))
    for table in (_table("### 7.1"), _table("### 7.2")):
        for reason, (_, rule_text) in table.items():
            assert set(re.findall(r"[GPD]-\d\d", rule_text)) <= rules, reason
    cases = [*prefill_cases(), *suite_cases()]
    assert {c.case_id for c in decode_cases()} <= {c.case_id for c in suite_cases()}
    for case in cases:
        assert set(_rule_ids(case.rule)) <= rules, (case.case_id, case.rule)


def test_case_ids_are_unique_and_every_refusal_has_a_case():
    for cases in (prefill_cases(), suite_cases()):
        ids = [c.case_id for c in cases]
        assert len(ids) == len(set(ids))
    covered = {c.expect.reason for c in decode_cases() if c.expect.code is not None}
    # every 7.1 refusal, and of the plane refusals (10.3) the one an inline peer can provoke
    assert covered == set(REFUSAL_STATUS) | {"REFERENCE_UNEXPECTED"}
