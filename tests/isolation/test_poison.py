"""--poison-freed-pages fills a freed page with NaN, so a read of freed KV cannot pass unseen;
under heavy page reuse every logit stays finite and every output equals the solo run.
--scrub-freed-pages zeroes freed pages instead."""

from __future__ import annotations

import random

import pytest
import torch

from common.kvpool.kv_cache import PoolConfig
from common.model.llama import DecodeBatch
from decode_svc.sequence import FinishedEvent
from tests.isolation.inproc import Harness, make_pool, tiny_model

PAGE = 4


@pytest.mark.parametrize("mode, expect", [("poison", "nan"), ("scrub", "zero"), ("none", "kept")])
def test_freed_pages_are_poisoned_or_scrubbed(mode, expect):
    model = tiny_model()
    pool = make_pool(model, PoolConfig(pool_tokens=8 * PAGE, page_size=PAGE,
                                       poison_freed=mode == "poison", scrub_freed=mode == "scrub"))
    pages = pool.allocator.allocate("a", 2 * PAGE)
    other = pool.allocator.allocate("b", PAGE)
    pool.k[:, pages + other] = 1.5
    pool.v[:, pages + other] = -2.5
    pool.release("a")
    freed_k, freed_v = pool.k[:, pages], pool.v[:, pages]
    if expect == "nan":
        assert torch.isnan(freed_k).all() and torch.isnan(freed_v).all()
    elif expect == "zero":
        assert (freed_k == 0).all() and (freed_v == 0).all()
    else:
        assert (freed_k == 1.5).all() and (freed_v == -2.5).all()
    # the page still owned by b is untouched
    assert (pool.k[:, other] == 1.5).all() and (pool.v[:, other] == -2.5).all()
    # a new owner of the freed pages sees the poison (or zeros) until it writes
    assert sorted(pool.allocator.allocate("c", 2 * PAGE)) == sorted(pages)


def test_a_poisoned_pool_starts_as_nan():
    model = tiny_model()
    pool = make_pool(model, PoolConfig(pool_tokens=4 * PAGE, page_size=PAGE, poison_freed=True))
    assert torch.isnan(pool.k).all() and torch.isnan(pool.v).all()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _decode_logits(harness: Harness, pages: list[int], prompt: list[int]) -> torch.Tensor:
    """One decode step for a sequence whose first len(prompt) tokens are said to be in pages."""
    n, d = len(prompt), harness.model.device
    batch = DecodeBatch(
        token_ids=torch.tensor([prompt[-1]], device=d), positions=torch.tensor([n], device=d),
        slot_mapping=torch.tensor([pages[n // PAGE] * PAGE + n % PAGE], device=d),
        page_table=torch.tensor([pages], dtype=torch.int32, device=d),
        seq_lens=torch.tensor([n + 1], dtype=torch.int32, device=d))
    return harness.model.decode(batch, harness.pool.k, harness.pool.v)


@pytest.mark.parametrize("device", DEVICES)
def test_reading_a_freed_page_deliberately_gives_nan(device):
    """The poison works: attention over a page after its release yields NaN logits, where the
    same read while the page was owned gave finite ones."""
    h = Harness(PoolConfig(pool_tokens=16 * PAGE, page_size=PAGE, poison_freed=True),
                device=device)
    h.close()  # only the model and pools are used here
    prompt = [3, 14, 15, 92, 65, 35, 89]
    pages = h.pool.allocator.allocate("a", len(prompt) + 1)
    _, kv, _ = h.prefill(prompt)
    table = torch.tensor(pages, dtype=torch.int32, device=h.model.device)
    for layer, layer_kv in enumerate(kv):
        h.model.ops.unpack_kv(layer_kv.to(h.model.device), h.pool.k[layer], h.pool.v[layer],
                              table, 0)
    assert torch.isfinite(_decode_logits(h, pages, prompt)).all()
    h.pool.release("a")
    assert torch.isnan(_decode_logits(h, pages, prompt)).all()


@pytest.mark.parametrize("device", DEVICES)
def test_heavy_page_reuse_keeps_logits_finite_and_outputs_exact(device):
    """48 requests through a 16-page pool: every page is reused many times; with poison on, any
    read of a stale slot would turn logits into NaN and change the output."""
    h = Harness(PoolConfig(pool_tokens=16 * PAGE, page_size=PAGE, poison_freed=True,
                           check_owners=True), max_batch=8, device=device)
    try:
        rng = random.Random(11)
        jobs = [([rng.randrange(2, 97) for _ in range(rng.randrange(1, 25))], rng.randrange(1, 14))
                for _ in range(48)]
        expected = [h.solo(prompt, max_tokens) for prompt, max_tokens in jobs]
        finite: list[bool] = []
        batch_sizes: list[int] = []
        real_decode = h.model.decode

        def checked_decode(batch, k, v):
            logits = real_decode(batch, k, v)
            finite.append(bool(torch.isfinite(logits).all()))
            batch_sizes.append(batch.token_ids.shape[0])
            return logits

        h.model.decode = checked_decode
        pages_handed = 0
        for i, (prompt, max_tokens) in enumerate(jobs):
            h.submit(f"r{i}", prompt, max_tokens)
            pages_handed += h.pool.allocator.pages_needed(len(prompt) + max_tokens - 1)
        outcomes = [h.wait(f"r{i}") for i in range(len(jobs))]
        assert all(isinstance(o.end, FinishedEvent) for o in outcomes)
        assert [o.tokens for o in outcomes] == expected
        assert finite and all(finite)
        assert max(batch_sizes) > 1  # requests shared steps, not only pages
        assert pages_handed > 5 * h.pool.allocator.num_pages  # the pages really were reused
        assert h.pages_free() == (16, 16)
        h.pool.allocator.check_invariants()
        assert h.log.events("page_ownership_violation") == []
    finally:
        h.close()
