"""The prefix cache under pressure through real services: a 64-page prefill pool, a cache capped
at 12 pages, chunked prefill, and six pairs of same-scope requests (a long prompt, then 30 ms
later a short one sharing its first 64 tokens, so both miss and the short one fills the cache
first). Every request is served with the tokens it gets without the cache, prefill never logs
a failed insert, the pools and stats end truthful, and a prompt of 63 of the 64 pages (it fits
only when every cached page can be evicted) is still served."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest

from common.pb.kvhandoff.v1 import generate_pb2, generate_pb2_grpc
from tests.helpers.checkpoints import SPECS, make_checkpoint
from tests.helpers.cluster import start_cluster

pytestmark = pytest.mark.slow

PAGE = 16
POOL_PAGES = 64
SPEC = replace(SPECS[0], name="llama-pressure", max_positions=1024)
FLAGS = ["--page-size", str(PAGE), "--max-context-tokens", "1024", "--poison-freed-pages",
         "--check-page-owners"]


def _pair(index: int) -> tuple[list[int], list[int]]:
    """A long prompt and a short one that shares its first 4 pages (64 tokens)."""
    base = [3 + (7 * index + 13 * i) % (SPEC.vocab - 3) for i in range(64)]
    long = base + [3 + (5 * i + index) % (SPEC.vocab - 3) for i in range(200 + 16 * index)]
    short = base + [4 + index, 5 + index, 6]
    return long, short


def _tokens(address: str, prompt: list[int], salt: str) -> list[int]:
    request = generate_pb2.GenerateRequest(max_tokens=4, ignore_eos=True, cache_salt=salt)
    request.token_ids.ids.extend(prompt)
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        return [r.token.token_id for r in stub.Generate(request, timeout=120)
                if r.HasField("token")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix_pressure")
    path, _ = make_checkpoint(SPEC, root)
    c = start_cluster(root / "run", str(path),
                      prefill_flags=["--pool-tokens", str(POOL_PAGES * PAGE),
                                     "--prefix-cache-max-pages", "12",
                                     "--prefill-chunk-tokens", "64"],
                      decode_flags=["--pool-tokens", "4096"], common_flags=FLAGS)
    yield c
    c.stop()


def test_pairs_under_pressure_lose_no_page_and_the_largest_prompt_is_served(cluster):
    pairs = [_pair(i) for i in range(6)]
    # the reference: no salt means no cache scope, so nothing is looked up or kept
    expected = [(_tokens(cluster.address, long, ""), _tokens(cluster.address, short, ""))
                for long, short in pairs]

    def run_pair(index: int) -> tuple[list[int], list[int]]:
        long, short = pairs[index]
        salt = f"pair-{index}"
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(_tokens, cluster.address, long, salt)
            time.sleep(0.03)
            second = pool.submit(_tokens, cluster.address, short, salt)
            return first.result(), second.result()

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(run_pair, range(6)))
    assert got == expected
    log = cluster.prefill.log_text()
    assert "prefix_cache_insert_failed" not in log and "could not reserve" not in log

    stats = cluster.prefill.stats()
    assert stats.pool.pages_total == POOL_PAGES
    assert stats.counters["prefix_cache_pages_inserted"] > 0
    assert stats.counters["prefix_cache_pages_evicted"] > 0  # the cap really was reached
    cluster.assert_pools_at_baseline()

    largest = [3 + (17 * i) % (SPEC.vocab - 3) for i in range((POOL_PAGES - 1) * PAGE)]
    assert len(_tokens(cluster.address, largest, "pair-0")) == 4
    cluster.assert_pools_at_baseline()
