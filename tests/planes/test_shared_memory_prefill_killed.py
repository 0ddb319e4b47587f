"""Prefill SIGKILLed mid-handoff on the shared-memory plane: the client gets PEER_UNAVAILABLE,
decode survives with its pool at baseline and removes the region the dead prefill left behind
(D-63, D-65)."""

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

pytestmark = pytest.mark.slow

DEADLINE = 30.0


def test_prefill_killed_mid_shared_memory_handoff(tmp_path):
    model = checkpoint(tmp_path)
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    plane = ["--shm-dir", str(shm)]
    prefill = start("prefill", tmp_path / "prefill", ["--model", model, *BOTH, *plane],
                    module=PATCHED, env={"KVH_TEST_SLOW_PREFILL_MARKER": str(SLOW_PREFILL),
                                         "KVH_TEST_SLOW_SECONDS": str(PREFILL_SECONDS_PER_CHUNK)})
    decode = None
    try:
        decode = start("decode", tmp_path / "decode",
                       ["--model", model, "--prefill", prefill.address, *BOTH, *plane,
                        "--data-plane", "shared-memory"], module=PATCHED,
                       env={"KVH_TEST_SLOW_DECODE_MARKER": str(SLOW_DECODE)})
        call = StreamCall(decode.address, SLOW_PREFILL_PROMPT, 8, DEADLINE).start()
        wait_pages_taken(prefill)
        deadline = time.monotonic() + 20
        while not list(shm.iterdir()):  # the first chunk is in its region
            assert time.monotonic() < deadline, "prefill never wrote a region"
            time.sleep(0.05)
        time.sleep(1.0)  # decode has read the first reference (prefill sleeps 2 s per chunk)
        prefill.stop(signal.SIGKILL)
        code, reason = call.outcome(DEADLINE + 5)
        assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "PEER_UNAVAILABLE")
        assert call.tokens == []
        assert decode.proc.poll() is None
        wait_baseline(decode)
        deadline = time.monotonic() + 10
        while list(shm.iterdir()):
            assert time.monotonic() < deadline, f"regions left: {list(shm.iterdir())}"
            time.sleep(0.05)
        assert '"plane": "shared-memory"' in decode.log_text()
    finally:
        for service in (decode, prefill):
            if service is not None:
                service.stop()
