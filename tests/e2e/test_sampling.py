"""Seeded sampling is reproducible across requests; temperature 0 is greedy."""

from __future__ import annotations

import pytest

from common.tokenizer import CharTokenizer
from tests.helpers.cluster import generate, start_cluster

pytestmark = pytest.mark.slow
PROMPT = [0, 40, 41, 42, 43, 44]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("sampling"), "demo",
                      common_flags=["--pool-tokens", "4096"])
    yield c
    c.stop()


def test_same_seed_same_tokens_other_seed_other_tokens(cluster):
    runs = [generate(cluster.address, token_ids=PROMPT, max_tokens=24, temperature=1.0,
                     seed=seed, ignore_eos=True).token_ids for seed in (11, 11, 12)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    cluster.assert_pools_at_baseline()


def test_temperature_zero_is_greedy(cluster):
    greedy = generate(cluster.address, token_ids=PROMPT, max_tokens=12, ignore_eos=True).token_ids
    zero = generate(cluster.address, token_ids=PROMPT, max_tokens=12, temperature=0.0, seed=5,
                    ignore_eos=True).token_ids
    sampled = generate(cluster.address, token_ids=PROMPT, max_tokens=12, temperature=1.5,
                       seed=5, ignore_eos=True).token_ids
    assert zero == greedy
    assert sampled != greedy


def test_top_k_one_is_greedy(cluster):
    greedy = generate(cluster.address, token_ids=PROMPT, max_tokens=12, ignore_eos=True).token_ids
    top1 = generate(cluster.address, token_ids=PROMPT, max_tokens=12, temperature=1.0, top_k=1,
                    seed=9, ignore_eos=True).token_ids
    assert top1 == greedy


def test_text_prompt_streams_text(cluster):
    """A text prompt is the demo tokenizer's ids, and the tokens stream their decoded text."""
    tokenizer = CharTokenizer()
    got = generate(cluster.address, text="Hello", max_tokens=8, ignore_eos=True)
    by_ids = generate(cluster.address, token_ids=tokenizer.encode("Hello"), max_tokens=8,
                      ignore_eos=True)
    assert len(got.token_ids) == 8 and got.token_ids == by_ids.token_ids
    assert got.text == tokenizer.decode(got.token_ids)
    assert got.text, "the demo's 8 greedy tokens decode to no text at all"
