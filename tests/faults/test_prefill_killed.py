"""Prefill SIGKILLed mid-handoff: the client gets UNAVAILABLE (PEER_UNAVAILABLE) well within its
deadline, decode survives with its pool at baseline, and once a prefill is back on the same port
decode's channel reconnects and serves the same greedy output as before."""

from __future__ import annotations

import signal

import grpc
import pytest

from tests.faults.slow_cluster import (
    SLOW_PREFILL_PROMPT,
    checkpoint,
    normal_output,
    normal_output_once_reachable,
    start_decode,
    start_prefill,
)
from tests.faults.waits import StreamCall, wait_baseline, wait_pages_taken

pytestmark = pytest.mark.slow

DEADLINE = 30.0


def test_prefill_killed_mid_handoff(tmp_path):
    model = checkpoint(tmp_path)
    prefill = start_prefill(model, tmp_path / "prefill-1")
    decode = start_decode(model, tmp_path / "decode", prefill)
    restarted = None
    try:
        before = normal_output(decode.address)
        call = StreamCall(decode.address, SLOW_PREFILL_PROMPT, 8, DEADLINE).start()
        wait_pages_taken(prefill)  # header sent, forward pass streaming its chunks
        prefill.stop(signal.SIGKILL)

        code, reason = call.outcome(DEADLINE + 5)
        assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "PEER_UNAVAILABLE")
        assert call.elapsed <= DEADLINE + 1
        assert call.tokens == []
        assert decode.proc.poll() is None
        wait_baseline(decode)
        assert decode.stats().refusals["PEER_UNAVAILABLE"] == 1

        port = int(prefill.address.rsplit(":", 1)[1])
        restarted = start_prefill(model, tmp_path / "prefill-2", port=port)
        assert restarted.address == prefill.address
        assert normal_output_once_reachable(decode.address) == before
        wait_baseline(decode)
        wait_baseline(restarted)
    finally:
        for service in (decode, prefill, restarted):
            if service is not None:
                service.stop()
