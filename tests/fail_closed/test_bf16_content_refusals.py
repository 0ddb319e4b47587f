"""The content refusals hold in bfloat16 on the cpu backend: the conformance cases that tamper
with a handoff's KV (every id, nonce, digest and checksum right, so only the content checks can
see it: D-45..D-47) are played against a real bf16 decode whose reference prefill is bf16 too,
both with `--kernels auto` (the cpu backend, oneDNN prepacked projections). bf16's tolerances
are 100x looser than float32's (SPEC.md 7.4); each tampering must still be refused with its
reason, no token out, the pool back at baseline, and the honest handoffs of the same suite
served, so a tolerance loose enough to hide a tampering, or too tight for bf16, fails here."""

from __future__ import annotations

import grpc
import pytest

from conformance.decode_cases import decode_cases
from conformance.spec import ERROR_DOMAIN
from tests.fail_closed.harness import DecodeHarness

pytestmark = pytest.mark.slow

BF16 = ("--dtype", "bfloat16")
CONTENT_REASONS = ("KV_NOT_FINITE", "KV_LAYER0_MISMATCH", "KV_DEPTH_MISMATCH")
TAMPERED = [c for c in decode_cases() if c.expect.reason in CONTENT_REASONS]
HONEST = [c for c in decode_cases() if c.expect.code is None]


@pytest.fixture(scope="module")
def bf16_harness(tmp_path_factory):
    h = DecodeHarness(tmp_path_factory.mktemp("bf16_content"), decode_flags=BF16,
                      prefill_flags=BF16)
    yield h
    h.close()


def test_both_services_run_bf16_on_the_cpu_backend(bf16_harness):
    for service in (bf16_harness.prefill, bf16_harness.decode):
        ready = [line for line in service.log_text().splitlines() if '"runtime_ready"' in line]
        assert ready and '"dtype": "bfloat16"' in ready[-1] and '"kernels": "cpu"' in ready[-1]


@pytest.mark.parametrize("case", TAMPERED, ids=lambda c: c.case_id)
def test_tampered_kv_is_refused_in_bf16(bf16_harness, case):
    run = bf16_harness.play(case)
    assert run.exchanges, f"decode never asked the fake prefill: {run.outcome.describe()}"
    assert run.tokens == []
    assert (run.outcome.code, run.outcome.reason) == (case.expect.code, case.expect.reason), \
        run.outcome.describe()
    assert run.outcome.domain == ERROR_DOMAIN
    lines = bf16_harness.log_events("handoff_refused", run.exchanges[0].request.request_id)
    assert [line["reason"] for line in lines] == [case.expect.reason], lines
    assert bf16_harness.pool_problem() is None


@pytest.mark.parametrize("case", HONEST, ids=lambda c: c.case_id)
def test_honest_handoff_is_served_in_bf16(bf16_harness, case):
    run = bf16_harness.play(case)
    assert run.outcome.code == grpc.StatusCode.OK, run.outcome.describe()
    assert run.tokens and run.tokens[0] == run.exchanges[0].reference_first_token
    assert bf16_harness.log_events("handoff_refused", run.exchanges[0].request.request_id) == []
    assert bf16_harness.pool_problem() is None
