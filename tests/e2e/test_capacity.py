"""Capacity is a checked fact: start-up refusal, and decode agreeing with prefill on model,
layout and limits before it serves anything."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.errors import error_reason
from tests.helpers.checkpoints import SPECS, make_checkpoint
from tests.helpers.cluster import REPO, generate, start_service
from tests.helpers.polling import assert_holds, wait_until

pytestmark = pytest.mark.slow


def test_pool_smaller_than_window_refuses_to_start():
    proc = subprocess.run(
        [sys.executable, "-m", "kvhandoff_cli.main", "prefill", "--model", "demo", "--port", "0",
         "--pool-tokens", "1000", "--max-context-tokens", "4096"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "refusing to start" in proc.stderr
    assert "992" in proc.stderr and "4096" in proc.stderr
    assert "--allow-context-beyond-pool" in proc.stderr


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5).status


def _wait_for_log(service, event: str, timeout: float = 60.0) -> None:
    wait_until(lambda: event in service.log_text(), timeout,
               lambda: f"{event} in log:\n{service.log_text()[-2000:]}")


@pytest.mark.parametrize("mismatch", ["model", "layout"])
def test_decode_refuses_to_serve_with_a_different_prefill(tmp_path, mismatch):
    if mismatch == "model":
        path, _ = make_checkpoint(SPECS[0], tmp_path)
        prefill_flags, decode_model = ["--model", str(path)], "demo"
    else:  # same weights, KV in another dtype
        prefill_flags, decode_model = ["--model", "demo", "--dtype", "bfloat16"], "demo"
    prefill = start_service("prefill", tmp_path / "run", [*prefill_flags, "--pool-tokens", "4096"])
    decode = start_service("decode", tmp_path / "run",
                           ["--model", decode_model, "--prefill", prefill.address,
                            "--pool-tokens", "4096"], wait_healthy=False)
    try:
        _wait_for_log(decode, "prefill_mismatch")
        assert _health(decode.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            generate(decode.address, token_ids=[3, 4, 5], max_tokens=2)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_reason(info.value) == "PREFILL_MISMATCH"
        assert prefill.stats().counters.get("forward_passes", 0) == 0
    finally:
        decode.stop()
        prefill.stop()


def test_pool_sized_from_a_byte_budget_is_reported(tmp_path):
    per_token = 2 * 4 * 2 * 64 * 4  # demo model, float32
    prefill = start_service("prefill", tmp_path, [
        "--model", "demo", "--pool-tokens", "0", "--kv-cache-bytes", str(per_token * 8192),
        "--memory-fraction", "0.5"])
    try:
        pool = prefill.stats().pool
        assert pool.tokens_total == 4096
        assert pool.max_prompt_tokens == 4096
        assert '"sized_by": "memory_fraction=0.5 of kv_cache_bytes"' in prefill.log_text()
    finally:
        prefill.stop()


def test_replicas_that_disagree_leave_decode_with_the_strictest_limit(tmp_path):
    flags = ["--model", "demo", "--max-context-tokens", "512", "--allow-context-beyond-pool"]
    loose = start_service("prefill", tmp_path / "a", [*flags, "--pool-tokens", "256"])
    strict = start_service("prefill", tmp_path / "b", [*flags, "--pool-tokens", "128"])
    target = f"ipv4:{loose.address},{strict.address}"
    decode = start_service("decode", tmp_path / "d", [
        "--model", "demo", "--prefill", target, "--pool-tokens", "2048",
        "--max-context-tokens", "512", "--prefill-info-interval-s", "0.2"])
    try:
        wait_until(lambda: decode.stats().pool.max_prompt_tokens == 128, 60,
                   lambda: f"decode at the strict replica's limit: {decode.stats().pool}")
        # round_robin asks each replica in turn every 0.2 s: over ten intervals decode hears
        # from the loose one again and again, and must keep the strict limit throughout
        assert_holds(lambda: decode.stats().pool.max_prompt_tokens == 128, 10 * 0.2,
                     lambda: f"decode at the strict limit: {decode.log_text()[-2000:]}")
        with pytest.raises(grpc.RpcError) as info:
            generate(decode.address, token_ids=[5] * 200, max_tokens=2)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "128" in info.value.details()
        assert len(generate(decode.address, token_ids=[5] * 100, max_tokens=2,
                            ignore_eos=True).token_ids) == 2
    finally:
        for service in (decode, loose, strict):
            service.stop()
