"""The services hand off over NIXL (decode READs each chunk straight from prefill's KV pages,
P-68) with greedy output identical to inline; pools return to baseline and prefill's pages are
held until decode releases them."""

from __future__ import annotations

import time

import grpc
import pytest

from tests.helpers.cluster import generate, handoff_stub, start_cluster
from tests.perf.helpers import prompt
from tests.planes.nixl_env import LOOPBACK_UCX, nixl_or_skip
from common.pb.kvhandoff.v1 import handoff_pb2

pytestmark = pytest.mark.slow

FLAGS = ["--page-size", "16", "--pool-tokens", "2048", "--max-context-tokens", "1024",
         "--poison-freed-pages", "--check-page-owners"]
# 700 tokens of demo KV are 700 KiB per layer: with a 256 KiB chunk limit, 3 chunks per layer
DECODE = ["--max-chunk-bytes", str(256 << 10)]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """NIXL with every handoff packed into a registered buffer (P-66), not read from pages."""
    nixl_or_skip()
    cluster = start_cluster(tmp_path_factory.mktemp("packed"), "demo", common_flags=FLAGS,
                            prefill_flags=["--no-shared-memory", "--no-nixl-from-pages"],
                            decode_flags=[*DECODE, "--data-plane", "nixl"], env=LOOPBACK_UCX)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    nixl_or_skip()
    root = tmp_path_factory.mktemp("nixl")
    inline = start_cluster(root / "inline", "demo", common_flags=FLAGS, decode_flags=DECODE)
    try:
        nixl = start_cluster(root / "nixl", "demo", common_flags=FLAGS,
                             prefill_flags=["--release-grace-s", "30", "--no-shared-memory",
                                            "--nixl-from-pages"],
                             decode_flags=[*DECODE, "--data-plane", "nixl"], env=LOOPBACK_UCX)
    except Exception:
        inline.stop()
        raise
    yield inline, nixl
    nixl.stop()
    inline.stop()


def _released(cluster, count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while cluster.prefill.stats().counters.get("handoff_releases", 0) < count:
        assert time.monotonic() < deadline, "decode never released its handoff"
        time.sleep(0.05)


@pytest.mark.parametrize("length", [1, 53, 700])
def test_nixl_output_equals_inline(pairs, length):
    inline, nixl = pairs
    before = nixl.prefill.stats().counters.get("handoff_releases", 0)
    ids = prompt(length, seed=length)
    via_inline = generate(inline.address, token_ids=ids, max_tokens=16, ignore_eos=True)
    via_nixl = generate(nixl.address, token_ids=ids, max_tokens=16, ignore_eos=True)
    assert len(via_nixl.token_ids) == 16 and via_nixl.token_ids == via_inline.token_ids
    nixl.assert_pools_at_baseline()
    _released(nixl, before + 1)  # decode's release, long before the 30 s grace period
    counters = nixl.prefill.stats().counters
    assert "handoff_releases_expired" not in counters
    # read straight from prefill's pages (P-68), held until that release and returned
    assert counters.get("nixl_page_leases", 0) >= before + 1
    assert counters.get("nixl_lease_pages_held", 0) == counters.get("nixl_lease_pages_returned", 0)
    assert "nixl_page_lease_fallbacks" not in counters


def test_the_handoffs_really_went_over_nixl(pairs):
    inline, nixl = pairs
    generate(nixl.address, token_ids=prompt(20, seed=3), max_tokens=2)
    assert '"plane": "nixl"' in nixl.decode.log_text()
    assert "handoff_releases" not in inline.prefill.stats().counters


def test_prefill_offers_nixl_first_with_its_agent_metadata(pairs):
    _, nixl = pairs
    with grpc.insecure_channel(nixl.prefill.address) as channel:
        info = handoff_stub(channel).GetPrefillInfo(handoff_pb2.GetPrefillInfoRequest(),
                                                    timeout=10)
    assert [o.plane for o in info.data_planes] == [handoff_pb2.DATA_PLANE_NIXL,
                                                   handoff_pb2.DATA_PLANE_INLINE]
    assert info.data_planes[0].nixl_agent_metadata


@pytest.mark.parametrize("length", [37, 700])
def test_greedy_output_over_the_pages_equals_the_packed_path(pairs, packed, length):
    _, nixl = pairs
    ids = prompt(length, seed=length + 1)
    via_pages = generate(nixl.address, token_ids=ids, max_tokens=16, ignore_eos=True)
    via_packed = generate(packed.address, token_ids=ids, max_tokens=16, ignore_eos=True)
    assert len(via_pages.token_ids) == 16 and via_pages.token_ids == via_packed.token_ids
    packed.assert_pools_at_baseline()
    nixl.assert_pools_at_baseline()
    counters = packed.prefill.stats().counters
    assert counters.get("nixl_page_leases", 0) == 0 and counters.get("handoff_releases", 0) >= 1
    assert '"path": "packed"' in packed.prefill.log_text()
    assert '"path": "pages"' in nixl.prefill.log_text()
