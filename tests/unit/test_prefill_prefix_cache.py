"""The prefill engine with the prefix cache (in-process, deterministic): a hit computes only the
tokens after the cached prefix, and the handoff it sends (every layer, every token, the first
token) equals the one computed without the cache; scopes never share; the pool ends at its
baseline with only cached pages left, and those poisoned when evicted."""

from __future__ import annotations

import io
import threading

import pytest
import torch

from common.config import PrefillConfig, ServiceConfig
from common.counters import Counters
from common.handoff.codec import bytes_to_kv
from common.handoff.layout import KvLayout
from common.kvpool.kv_cache import KvPool, PoolConfig
from common.log import make_logger
from common.model.llama import LlamaModel
from common.model.loader import load_model
from common.ops.torch_ops import TorchOps
from common.pb.kvhandoff.v1 import handoff_pb2
from common.sampling import SamplingConfig
from prefill_svc.engine import PrefillEngine, PrefillJob
from prefill_svc.prefix_cache import PrefixCache, PrefixCacheConfig
from prefill_svc.send_budget import SendBudget

PAGE = 4
SYSTEM = [3 + (7 * i) % 90 for i in range(21)]  # 5 whole pages and a token
TURNS = [[9, 8, 7], [11, 12, 13, 14, 15, 16], [40]]
# A hit attends over the pages (paged prefill attention), a miss over its own K/V: the two
# differ by float32 rounding only (SPEC.md 8: two correct fp32 prefills, at most 4.4e-5 apart).
TOL = {"rtol": 1e-4, "atol": 1e-4}


class Harness:
    def __init__(self, enabled: bool, pool_tokens: int = 512, max_pages: int = 0,
                 chunk: int = 2048) -> None:
        loaded = load_model("demo")
        c = loaded.config
        model = LlamaModel(c, loaded.weights, TorchOps(), torch.device("cpu"), torch.float32)
        self.pool = KvPool(PoolConfig(pool_tokens=pool_tokens, page_size=PAGE, poison_freed=True,
                                      check_owners=True),
                           c.num_layers, c.num_kv_heads, c.head_dim, torch.float32,
                           torch.device("cpu"))
        self.layout = KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32)
        self.counters = Counters()
        self.cache = PrefixCache(self.pool, PrefixCacheConfig(enabled, max_pages), self.counters)
        self.engine = PrefillEngine(
            model, self.pool, self.layout, 4096, make_logger("prefill", stream=io.StringIO()),
            self.counters, SendBudget(PrefillConfig(ServiceConfig()).max_unsent_bytes),
            prefill_chunk_tokens=chunk, prefix_cache=self.cache)
        self.engine.start()

    def run(self, request_id: str, tokens: list[int], scope: bytes
            ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One handoff: (K, V) as decode would assemble them, [L, n, Hkv, D], and the first
        token."""
        frames: list = []
        ended = threading.Event()

        def emit(frame) -> None:
            if frame is None:
                ended.set()
            else:
                frames.append(handoff_pb2.PrefillResponse.FromString(frame))

        self.engine.submit(PrefillJob(request_id, tokens, SamplingConfig(), 8, emit,
                                      cache_scope=scope))
        assert ended.wait(60)
        commit = frames[-1].commit
        assert commit.status == handoff_pb2.HANDOFF_STATUS_OK, commit.reason
        n, layout = len(tokens), self.layout
        k = torch.full((layout.num_layers, n, layout.num_kv_heads, layout.head_dim), float("nan"))
        v = k.clone()
        for frame in frames[:-1]:
            chunk = frame.chunk
            count = chunk.token_end - chunk.token_start
            kv = bytes_to_kv(layout, chunk.k, chunk.v, count)
            k[chunk.layer, chunk.token_start:chunk.token_end] = kv[0]
            v[chunk.layer, chunk.token_start:chunk.token_end] = kv[1]
        return k, v, commit.first_token_id

    def stop(self) -> None:
        self.engine.stop()


@pytest.fixture(params=[2048, 5], ids=["one_pass", "chunks_of_5"])
def both(request):
    """The cache on and off; the rest of a hit in one pass, or in chunked-prefill passes of 5
    tokens (starting mid-page, after the cached pages)."""
    on, off = Harness(True, chunk=request.param), Harness(False, chunk=request.param)
    yield on, off
    on.stop()
    off.stop()


def test_hits_compute_only_the_suffix_and_hand_off_the_same_kv(both):
    on, off = both
    for i, turn in enumerate(TURNS * 2):
        prompt = SYSTEM + turn
        k_on, v_on, first_on = on.run(f"on{i}", prompt, b"tenant")
        k_off, v_off, first_off = off.run(f"off{i}", prompt, b"tenant")
        assert not k_on.isnan().any() and not v_on.isnan().any()
        torch.testing.assert_close(k_on, k_off, **TOL)
        torch.testing.assert_close(v_on, v_off, **TOL)
        assert first_on == first_off
    counters = on.counters.snapshot()
    assert counters["prefix_cache_misses"] == 1 and counters["prefix_cache_hits"] == 5
    assert counters["prefix_cache_hit_tokens"] >= 5 * 20
    computed = sum(len(SYSTEM) + len(t) for t in TURNS * 2)
    assert counters["prefill_tokens_computed"] == computed - counters["prefix_cache_hit_tokens"]
    assert off.counters.snapshot()["prefill_tokens_computed"] == computed
    for h in both:
        snap = h.pool.allocator.snapshot()
        assert snap.pages_available == snap.pages_total
        h.pool.allocator.check_invariants()
        h.cache.check_invariants()
    assert off.pool.allocator.snapshot().pages_cached == 0


def test_another_scope_computes_everything_whatever_was_cached(both):
    on, _ = both
    on.run("a0", SYSTEM + TURNS[0], b"tenant-a")
    on.run("a1", SYSTEM + TURNS[1], b"tenant-a")
    before = on.counters.snapshot()
    on.run("b0", SYSTEM + TURNS[1], b"tenant-b")
    after = on.counters.snapshot()
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] == len(
        SYSTEM + TURNS[1])
    assert after["prefix_cache_hit_tokens"] == before["prefix_cache_hit_tokens"]
    assert on.cache.snapshot().scopes == 2
    on.run("n0", SYSTEM + TURNS[1], b"")  # no scope: no lookup, no insert
    assert on.counters.snapshot()["prefix_cache_hit_tokens"] == after["prefix_cache_hit_tokens"]
    assert on.cache.snapshot().scopes == 2


def test_a_small_pool_evicts_and_stays_correct():
    """A pool of 12 pages: every prompt of another scope evicts the cached prefix of the last;
    outputs stay those of the cache-less engine; freed cached pages are poisoned (any read of
    one would turn KV NaN, which the first assertion would catch)."""
    on, off = Harness(True, pool_tokens=12 * PAGE), Harness(False, pool_tokens=12 * PAGE)
    try:
        for i in range(8):
            scope = b"abc"[i % 3:i % 3 + 1]
            prompt = SYSTEM + TURNS[i % 3]
            k_on, v_on, first_on = on.run(f"on{i}", prompt, scope)
            k_off, v_off, first_off = off.run(f"off{i}", prompt, scope)
            assert not k_on.isnan().any()
            torch.testing.assert_close(k_on, k_off, **TOL)
            torch.testing.assert_close(v_on, v_off, **TOL)
            assert first_on == first_off
        assert on.counters.get("prefix_cache_pages_evicted") > 0
        on.cache.check_invariants()
        on.pool.allocator.check_invariants()
        snap = on.pool.allocator.snapshot()
        assert snap.pages_available == snap.pages_total
        free = [p for p in range(snap.pages_total) if not on.pool.allocator.is_cached(p)]
        assert all(on.pool.k[:, p].isnan().all() for p in free)  # nothing left unpoisoned
    finally:
        on.stop()
        off.stop()
