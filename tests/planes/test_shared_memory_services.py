"""The services hand off over shared memory with output identical to inline; regions are
private, released by decode, and gone once the handoff is over; a prefill that does not serve
the plane rejects it with DATA_PLANE_UNAVAILABLE."""

from __future__ import annotations

import time

import grpc
import pytest

from common.errors import error_reason
from common.handoff.binding import new_nonce
from common.handoff.layout import protocol_version
from common.pb.kvhandoff.v1 import handoff_pb2
from tests.helpers.cluster import generate, handoff_stub, start_cluster
from tests.ops.helpers import log_events
from tests.perf.helpers import prompt

pytestmark = pytest.mark.slow

FLAGS = ["--page-size", "16", "--pool-tokens", "2048", "--max-context-tokens", "1024",
         "--poison-freed-pages", "--check-page-owners"]
# 700 tokens of demo KV are 700 KiB per layer: with a 256 KiB chunk limit, 3 chunks per layer
DECODE = ["--max-chunk-bytes", str(256 << 10)]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("planes")
    shm = root / "shm"
    shm.mkdir(mode=0o700)
    inline = start_cluster(root / "inline", "demo", common_flags=FLAGS, decode_flags=DECODE)
    try:
        shared = start_cluster(
            root / "shared", "demo", common_flags=[*FLAGS, "--shm-dir", str(shm)],
            prefill_flags=["--release-grace-s", "30", "--no-nixl"],
            decode_flags=[*DECODE, "--data-plane", "shared-memory"])
    except Exception:
        inline.stop()
        raise
    yield inline, shared, shm
    shared.stop()
    inline.stop()


def _wait_empty(directory, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while list(directory.iterdir()):
        assert time.monotonic() < deadline, f"regions left: {list(directory.iterdir())}"
        time.sleep(0.05)


@pytest.mark.parametrize("length", [1, 53, 700])
def test_shared_memory_output_equals_inline(pairs, length):
    inline, shared, shm = pairs
    ids = prompt(length, seed=length)
    via_inline = generate(inline.address, token_ids=ids, max_tokens=16, ignore_eos=True)
    via_shm = generate(shared.address, token_ids=ids, max_tokens=16, ignore_eos=True)
    assert len(via_shm.token_ids) == 16 and via_shm.token_ids == via_inline.token_ids
    shared.assert_pools_at_baseline()
    _wait_empty(shm)  # decode's release came long before the 30 s grace period


def test_the_content_checks_ran_as_the_kv_landed(pairs):
    """Both planes: each handoff's checks were measured layer by layer as its chunks (3 a
    layer at 700 tokens) landed, and judged after the commit (decode's own first token)."""
    for pair in pairs[:2]:
        ids = prompt(700, seed=11)
        generate(pair.address, token_ids=ids, max_tokens=2, ignore_eos=True)
        checked = [e for e in log_events(pair.decode)
                   if e.get("event") == "handoff_content_verified"
                   and e.get("prompt_tokens") == 700]
        assert checked and all(e["landed_seconds"] > 0 for e in checked), checked
        timeline = [e["timeline_ms"] for e in log_events(pair.decode)
                    if e.get("event") == "handoff_verified" and e.get("prompt_tokens") == 700]
        assert timeline and all(list(t)[-1] == "verified" and "first_chunk" in t
                                and "stream_ended" in t for t in timeline), timeline


def test_the_handoffs_really_went_over_shared_memory(pairs):
    inline, shared, shm = pairs
    before = shared.prefill.stats().counters.get("handoff_releases", 0)
    generate(shared.address, token_ids=prompt(20, seed=3), max_tokens=2)
    deadline = time.monotonic() + 10
    while shared.prefill.stats().counters.get("handoff_releases", 0) != before + 1:
        assert time.monotonic() < deadline, "decode never released its handoff"
        time.sleep(0.05)
    assert '"plane": "shared-memory"' in shared.decode.log_text()
    assert "handoff_releases" not in inline.prefill.stats().counters


def test_prefill_offers_shared_memory_with_its_host_identity(pairs):
    inline, shared, _ = pairs
    with grpc.insecure_channel(shared.prefill.address) as channel:
        info = handoff_stub(channel).GetPrefillInfo(handoff_pb2.GetPrefillInfoRequest(),
                                                    timeout=10)
    planes = [o.plane for o in info.data_planes]
    assert planes == [handoff_pb2.DATA_PLANE_SHARED_MEMORY, handoff_pb2.DATA_PLANE_INLINE]
    assert info.data_planes[0].host_id


def test_a_plane_prefill_does_not_serve_is_rejected(tmp_path):
    cluster = start_cluster(tmp_path, "demo", common_flags=FLAGS,
                            prefill_flags=["--no-shared-memory", "--no-nixl"])
    try:
        request = handoff_pb2.PrefillRequest(
            request_id="r1", token_ids=[1, 2, 3], protocol_version=protocol_version(),
            nonce=new_nonce(), data_plane=handoff_pb2.DATA_PLANE_SHARED_MEMORY)
        with grpc.insecure_channel(cluster.prefill.address) as channel:
            stub = handoff_stub(channel)
            info = stub.GetPrefillInfo(handoff_pb2.GetPrefillInfoRequest(), timeout=10)
            assert [o.plane for o in info.data_planes] == [handoff_pb2.DATA_PLANE_INLINE]
            call = stub.Prefill(request, timeout=30)
            frames = []
            with pytest.raises(grpc.RpcError) as err:
                for frame in call:
                    frames.append(frame)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_reason(err.value) == "DATA_PLANE_UNAVAILABLE"
        assert [f.WhichOneof("frame") for f in frames] == ["header"]
        assert frames[0].header.status == handoff_pb2.HANDOFF_STATUS_REJECTED
        assert frames[0].header.reason_code == "DATA_PLANE_UNAVAILABLE"
        cluster.assert_pools_at_baseline()
    finally:
        cluster.stop()
