"""Over-length and out-of-vocabulary prompts are refused with a specific status, no token comes
back, no forward pass runs, and both pools are at their baseline afterwards (the 2026 case)."""

from __future__ import annotations

import grpc
import pytest

from common.errors import error_reason
from common.handoff.binding import new_nonce
from common.handoff.layout import protocol_version
from common.pb.kvhandoff.v1 import handoff_pb2
from tests.helpers.cluster import generate, handoff_stub, start_cluster

pytestmark = pytest.mark.slow

WINDOW = 256
PREFILL_POOL = 64  # smaller than the window: the incident's configuration, made explicit


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(
        tmp_path_factory.mktemp("limits"), "demo",
        common_flags=["--max-context-tokens", str(WINDOW), "--page-size", "16",
                      "--poison-freed-pages", "--check-page-owners"],
        prefill_flags=["--pool-tokens", str(PREFILL_POOL), "--allow-context-beyond-pool"],
        decode_flags=["--pool-tokens", "1024"])
    yield c
    c.stop()


def _refused(address: str, prompt: list[int]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        generate(address, token_ids=prompt, max_tokens=4)
    return info.value


def test_a_prompt_that_fits_generates(cluster):
    got = generate(cluster.address, token_ids=[5] * (PREFILL_POOL - 1), max_tokens=4,
                   ignore_eos=True)
    assert len(got.token_ids) == 4
    cluster.assert_pools_at_baseline()


def test_prompt_beyond_prefill_pool_within_window_is_resource_exhausted(cluster):
    before = cluster.prefill.stats().counters.get("forward_passes", 0)
    seen_by_prefill = cluster.prefill.stats().refusals.get("POOL_TOO_SMALL", 0)
    n = PREFILL_POOL + 36
    err = _refused(cluster.address, [7] * n)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(n) in err.details() and str(PREFILL_POOL) in err.details()
    assert error_reason(err) == "POOL_TOO_SMALL"
    assert cluster.prefill.stats().counters.get("forward_passes", 0) == before
    # decode knew prefill's limit from the handshake and never called prefill
    assert cluster.prefill.stats().refusals.get("POOL_TOO_SMALL", 0) == seen_by_prefill
    cluster.assert_pools_at_baseline()


def test_prefill_itself_rejects_beyond_its_pool_without_kv(cluster):
    """Asked directly (as a buggy decode might), prefill sends REJECTED and no chunk."""
    before = cluster.prefill.stats().counters.get("forward_passes", 0)
    n = PREFILL_POOL + 1
    request = handoff_pb2.PrefillRequest(request_id="direct-1", token_ids=[7] * n,
                                         protocol_version=protocol_version(), nonce=new_nonce())
    frames = []
    with grpc.insecure_channel(cluster.prefill.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            for frame in handoff_stub(channel).Prefill(request, timeout=30):
                frames.append(frame)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(n) in info.value.details() and str(PREFILL_POOL) in info.value.details()
    assert len(frames) == 1 and frames[0].WhichOneof("frame") == "header"
    assert frames[0].header.status == handoff_pb2.HANDOFF_STATUS_REJECTED
    assert frames[0].header.reason_code == "POOL_TOO_SMALL"
    assert cluster.prefill.stats().counters.get("forward_passes", 0) == before
    cluster.assert_pools_at_baseline()


def test_prompt_over_the_window_is_invalid_argument(cluster):
    err = _refused(cluster.address, [7] * (WINDOW + 1))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason(err) == "PROMPT_TOO_LONG"
    assert str(WINDOW) in err.details()
    cluster.assert_pools_at_baseline()


def test_token_outside_the_vocabulary_is_invalid_argument(cluster):
    err = _refused(cluster.address, [5, 6, 100_000])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason(err) == "TOKEN_OUT_OF_VOCAB"
    assert "100000" in err.details()
    cluster.assert_pools_at_baseline()


def test_empty_prompt_is_invalid_argument(cluster):
    err = _refused(cluster.address, [])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    cluster.assert_pools_at_baseline()


def test_max_tokens_past_the_window_is_invalid_argument(cluster):
    with pytest.raises(grpc.RpcError) as info:
        generate(cluster.address, token_ids=[5] * 10, max_tokens=WINDOW)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason(info.value) == "MAX_TOKENS_TOO_LARGE"
    cluster.assert_pools_at_baseline()
