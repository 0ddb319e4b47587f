"""Every refusal of SPEC.md section 7.1, played against a real decode through the fake prefill:
the client sees the status and ErrorInfo reason, no token comes out, decode logs exactly one
`handoff_refused` line for the request, counts it in kvhandoff_refused_total, and its pool is
back at baseline."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from conformance.decode_cases import decode_cases
from conformance.decode_script import Expect
from conformance.spec import ERROR_DOMAIN

pytestmark = pytest.mark.slow

STALL_CLIENT_DEADLINE = 60.0  # decode's own --handoff-timeout-s (5 s) fires first


def _refusal_cases():
    cases = []
    for case in decode_cases():
        if case.expect.code is None or case.level != "MUST":  # SHOULD: a stricter repeat
            continue
        if case.case_id == "stall_past_deadline":  # strict here: decode's timeout is shorter
            case = dataclasses.replace(case, deadline=STALL_CLIENT_DEADLINE, expect=Expect(
                grpc.StatusCode.DEADLINE_EXCEEDED, "HANDOFF_TIMEOUT"))
        cases.append(case)
    return cases


REFUSALS = _refusal_cases()
GOOD = [c for c in decode_cases() if c.expect.code is None]


@pytest.mark.parametrize("case", REFUSALS, ids=lambda c: c.case_id)
def test_refusal_fails_closed(harness, case):
    reason = case.expect.reason
    before = harness.refused_counts().get(reason, 0.0)
    run = harness.play(case)
    assert run.exchanges, f"decode never asked the fake prefill: {run.outcome.describe()}"
    assert not run.exchanges[0].error, run.exchanges[0].error
    assert run.tokens == []
    assert (run.outcome.code, run.outcome.reason) == (case.expect.code, reason), \
        run.outcome.describe()
    assert run.outcome.domain == ERROR_DOMAIN
    request_id = run.exchanges[0].request.request_id
    lines = harness.log_events("handoff_refused", request_id)
    assert [line["reason"] for line in lines] == [reason], lines
    assert lines[0]["code"] == case.expect.code.name
    assert harness.refused_counts().get(reason, 0.0) - before == 1.0
    assert all(e.done.is_set() for e in run.exchanges), "decode left its prefill call open"
    assert harness.pool_problem() is None


@pytest.mark.parametrize("case", GOOD, ids=lambda c: c.case_id)
def test_good_handoff_is_served(harness, case):
    before = harness.refused_counts()
    run = harness.play(case)
    assert run.outcome.code == grpc.StatusCode.OK, run.outcome.describe()
    # decode streams its own first token (D-48): an honest prefill's, whatever the commit said
    assert len(run.tokens) == 2 and run.tokens[0] == run.exchanges[0].reference_first_token
    assert harness.log_events("handoff_refused", run.exchanges[0].request.request_id) == []
    assert harness.refused_counts() == before
    assert harness.pool_problem() is None

