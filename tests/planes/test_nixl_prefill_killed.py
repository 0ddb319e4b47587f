"""Prefill SIGKILLed mid-handoff on the NIXL plane (real processes): the client gets a refusal
(PEER_UNAVAILABLE when the stream breaks first, TRANSFER_FAILED when a READ does), decode
survives with its pool at baseline and serves no tokens of that handoff."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from tests.faults.slow_cluster import (
    BOTH,
    PREFILL_SECONDS_PER_CHUNK,
    SLOW_DECODE,
    SLOW_PREFILL,
    SLOW_PREFILL_PROMPT,
    checkpoint,
)
from tests.faults.waits import StreamCall, wait_baseline, wait_pages_taken
from tests.isolation.launch import PATCHED, start
from tests.planes.nixl_env import LOOPBACK_UCX, nixl_or_skip

pytestmark = pytest.mark.slow

DEADLINE = 30.0


def test_prefill_killed_mid_nixl_handoff(tmp_path):
    nixl_or_skip()
    model = checkpoint(tmp_path)
    prefill = start("prefill", tmp_path / "prefill", ["--model", model, *BOTH],
                    module=PATCHED, env={**LOOPBACK_UCX,
                                         "KVH_TEST_SLOW_PREFILL_MARKER": str(SLOW_PREFILL),
                                         "KVH_TEST_SLOW_SECONDS": str(PREFILL_SECONDS_PER_CHUNK)})
    decode = None
    try:
        decode = start("decode", tmp_path / "decode",
                       ["--model", model, "--prefill", prefill.address, *BOTH,
                        "--data-plane", "nixl"], module=PATCHED,
                       env={**LOOPBACK_UCX, "KVH_TEST_SLOW_DECODE_MARKER": str(SLOW_DECODE)})
        call = StreamCall(decode.address, SLOW_PREFILL_PROMPT, 8, DEADLINE).start()
        wait_pages_taken(prefill)
        time.sleep(PREFILL_SECONDS_PER_CHUNK + 1.0)  # decode has READ the first chunk
        prefill.stop(signal.SIGKILL)
        code, reason = call.outcome(DEADLINE + 5)
        assert (code, reason) in {(grpc.StatusCode.UNAVAILABLE, "PEER_UNAVAILABLE"),
                                  (grpc.StatusCode.UNAVAILABLE, "TRANSFER_FAILED")}
        assert call.tokens == []
        assert decode.proc.poll() is None
        wait_baseline(decode)
        assert '"plane": "nixl"' in decode.log_text()
    finally:
        for service in (decode, prefill):
            if service is not None:
                service.stop()
