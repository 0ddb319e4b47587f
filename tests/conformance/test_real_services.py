"""Our real prefill and decode pass every case of the conformance suite."""

from __future__ import annotations

import pytest

from tests.conformance.suite_process import run_decode_suite, run_prefill_suite
from tests.helpers.cluster import start_service

pytestmark = pytest.mark.slow


def test_prefill_passes_every_case(reference_prefill, tmp_path):
    run = run_prefill_suite(reference_prefill.address, tmp_path)
    assert run.returncode == 0, run.output
    assert run.outcomes and set(run.outcomes.values()) == {"pass"}, run.output
    assert "reject_beyond_pool" in run.outcomes  # applicable: the pool is below the window


def test_decode_passes_every_case(reference_prefill, tmp_path):
    run = run_decode_suite(lambda flags: start_service("decode", tmp_path / "decode", flags),
                           reference_prefill.address, tmp_path, ["--stall-deadline", "5"])
    assert run.returncode == 0, run.output
    assert run.outcomes and set(run.outcomes.values()) == {"pass"}, run.output
    assert {"stall_past_deadline", "stall_reason_reported", "chunk_over_max",
            "frame_malformed"} <= set(run.outcomes)
