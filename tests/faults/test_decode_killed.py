"""Decode SIGKILLed with one request mid-generation and one mid-handoff: both clients get
UNAVAILABLE within their deadline, prefill notices the broken stream and frees everything, and a
new decode in front of the same prefill serves the same greedy output as before."""

from __future__ import annotations

import signal

import grpc
import pytest

from tests.faults.slow_cluster import (
    SLOW_DECODE_PROMPT,
    SLOW_PREFILL_PROMPT,
    checkpoint,
    normal_output,
    start_decode,
    start_prefill,
)
from tests.faults.waits import StreamCall, wait_baseline, wait_pages_taken

pytestmark = pytest.mark.slow

DEADLINE = 30.0


def test_decode_killed_mid_generation_and_mid_handoff(tmp_path):
    model = checkpoint(tmp_path)
    prefill = start_prefill(model, tmp_path / "prefill")
    decode = start_decode(model, tmp_path / "decode-1", prefill)
    replacement = None
    try:
        before = normal_output(decode.address)
        generating = StreamCall(decode.address, SLOW_DECODE_PROMPT, 100, DEADLINE).start()
        generating.wait_tokens(2)
        handing_off = StreamCall(decode.address, SLOW_PREFILL_PROMPT, 8, DEADLINE).start()
        wait_pages_taken(prefill)
        decode.stop(signal.SIGKILL)

        for call in (generating, handing_off):
            code, _ = call.outcome(DEADLINE + 5)
            assert code == grpc.StatusCode.UNAVAILABLE
            assert call.elapsed <= DEADLINE + 1
        assert 2 <= len(generating.tokens) < 100
        assert handing_off.tokens == []
        assert prefill.proc.poll() is None
        wait_baseline(prefill)

        replacement = start_decode(model, tmp_path / "decode-2", prefill)
        assert normal_output(replacement.address) == before
        wait_baseline(prefill)
        wait_baseline(replacement)
    finally:
        for service in (replacement, decode, prefill):
            if service is not None:
                service.stop()
