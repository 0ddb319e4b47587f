"""The prefix cache through real services (decode computes the scope, prefill keys on it):
greedy outputs with and without the cache are identical; two tenants with the same prefix never
share a page, and tenant B's prefill work does not depend on what tenant A cached (read from
prefill's StatsService counters, not timed); concurrent requests on a pool small enough to
evict keep every output equal to its solo run, and both pools end at their baseline."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.pb.kvhandoff.v1 import generate_pb2, generate_pb2_grpc
from tests.helpers.checkpoints import SPECS, make_checkpoint
from tests.helpers.cluster import start_cluster

pytestmark = pytest.mark.slow

PAGE = 4
VOCAB = SPECS[0].vocab
SYSTEM = [3 + (11 * i) % (VOCAB - 3) for i in range(26)]  # 6 whole pages and 2 tokens
TURNS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [15, 16, 17, 18, 19]]
FLAGS = ["--page-size", str(PAGE), "--poison-freed-pages", "--check-page-owners"]


def _generate(address: str, prompt: list[int], salt: str, max_tokens: int = 6,
              token: str = "") -> list[int]:
    request = generate_pb2.GenerateRequest(max_tokens=max_tokens, ignore_eos=True,
                                           cache_salt=salt)
    request.token_ids.ids.extend(prompt)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(address) as channel:
        out = []
        for response in generate_pb2_grpc.GenerationServiceStub(channel).Generate(
                request, timeout=120, metadata=metadata):
            if response.HasField("token"):
                out.append(response.token.token_id)
        return out


def _counters(cluster) -> dict[str, int]:
    return dict(cluster.prefill.stats().counters)


def _delta(before: dict[str, int], after: dict[str, int], name: str) -> int:
    return after.get(name, 0) - before.get(name, 0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix_cache")
    path, _ = make_checkpoint(SPECS[0], root)
    c = start_cluster(root / "run", str(path), prefill_flags=["--pool-tokens", "96",
                                                             "--allow-context-beyond-pool"],
                      decode_flags=["--pool-tokens", "512"], common_flags=FLAGS)
    yield c
    c.stop()


def test_outputs_with_and_without_the_cache_are_identical(cluster):
    prompts = [SYSTEM + turn for turn in TURNS]
    start = _counters(cluster)
    uncached = [_generate(cluster.address, p, "") for p in prompts]  # empty scope: no cache
    before = _counters(cluster)
    assert _delta(start, before, "prefix_cache_unscoped") == len(prompts)
    assert _delta(start, before, "prefix_cache_hit_tokens") == 0
    cached = [_generate(cluster.address, p, "tenant-x") for p in prompts + prompts]
    after = _counters(cluster)
    assert cached == uncached + uncached
    assert _delta(before, after, "prefix_cache_hits") == 2 * len(prompts) - 1
    assert _delta(before, after, "prefix_cache_hit_tokens") >= (2 * len(prompts) - 1) * 24
    cluster.assert_pools_at_baseline()


def test_tenants_never_share_and_b_does_not_depend_on_a(cluster):
    prompt = SYSTEM[:22] + [20, 21, 22]  # 6 whole pages and a token
    # B computes the prompt before any tenant cached it ...
    before = _counters(cluster)
    first_b = _generate(cluster.address, prompt, "tenant-b1")
    alone = _counters(cluster)
    # ... then A caches it (its second request hits) ...
    _generate(cluster.address, prompt, "tenant-a")
    after_a1 = _counters(cluster)
    assert _generate(cluster.address, prompt, "tenant-a") == first_b
    after_a = _counters(cluster)
    assert _delta(after_a1, after_a, "prefix_cache_hit_tokens") == 24
    # ... and another B computes it again, exactly as much as before A cached it
    assert _generate(cluster.address, prompt, "tenant-b2") == first_b
    after_b = _counters(cluster)
    for name in ("prefill_tokens_computed", "prefix_cache_hit_tokens", "prefix_cache_misses",
                 "prefix_cache_pages_inserted"):
        assert _delta(after_a, after_b, name) == _delta(before, alone, name), name
    assert _delta(after_a, after_b, "prefill_tokens_computed") == len(prompt)
    assert _delta(after_a, after_b, "prefix_cache_hit_tokens") == 0
    # each tenant's pages are its own: B's complete pages were inserted, not found
    assert _delta(after_a, after_b, "prefix_cache_pages_inserted") == 6
    cluster.assert_pools_at_baseline()


def test_eviction_under_concurrent_load_keeps_every_output(cluster):
    """24 prefill pages, 4 tenants each sharing a prefix of 6 pages: the cache cannot hold them
    all, so admissions evict while other requests read their cached pages."""
    jobs = [(SYSTEM[t:t + 22] + TURNS[i % 4] + [t + 3], f"tenant-{t}")
            for t in range(4) for i in range(4)]
    solo = {}
    for prompt, salt in jobs:
        key = (tuple(prompt), salt)
        if key not in solo:
            solo[key] = _generate(cluster.address, prompt, "")  # no cache at all
    before = _counters(cluster)
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda job: _generate(cluster.address, *job), jobs * 2))
    after = _counters(cluster)
    for (prompt, salt), got in zip(jobs * 2, results, strict=True):
        assert got == solo[(tuple(prompt), salt)], (salt, prompt[:4])
    assert _delta(before, after, "prefix_cache_pages_evicted") > 0
    assert _delta(before, after, "prefix_cache_hits") > 0
    cluster.assert_pools_at_baseline()


def test_the_bearer_token_is_an_identity_of_its_own(tmp_path):
    """With --api-token and no salt, the token's holder shares with itself (the second request
    hits); a salt gives the same holder a separate scope (no hit)."""
    path, _ = make_checkpoint(SPECS[0], tmp_path)
    c = start_cluster(tmp_path / "run", str(path), decode_flags=["--api-token", "s3cret"],
                      common_flags=FLAGS)
    try:
        prompt = SYSTEM + TURNS[0]
        before = _counters(c)
        first = _generate(c.address, prompt, "", token="s3cret")
        assert _generate(c.address, prompt, "", token="s3cret") == first
        after = _counters(c)
        assert _delta(before, after, "prefix_cache_hits") == 1
        assert _delta(before, after, "prefix_cache_unscoped") == 0
        assert _generate(c.address, prompt, "salted", token="s3cret") == first
        assert _delta(after, _counters(c), "prefix_cache_hits") == 0
        pool = c.prefill.stats().pool  # decode's StatsService is behind the token too
        assert pool.pages_free == pool.pages_total
    finally:
        c.stop()
