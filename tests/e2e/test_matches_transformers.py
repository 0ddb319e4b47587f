"""Disaggregated greedy generation equals transformers' generate, token for token."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.checkpoints import SPECS, hf_greedy, make_checkpoint
from tests.helpers.cluster import generate, start_cluster

pytestmark = pytest.mark.slow

PAGE = 16
PROMPT_LENGTHS = [1, PAGE, 3 * PAGE + 5]  # one token, exactly one page, pages plus a remainder
NEW_TOKENS = 16


@pytest.fixture(scope="module", params=SPECS, ids=lambda s: s.name)
def served(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param.name)
    path, hf_model = make_checkpoint(request.param, root)
    cluster = start_cluster(root / "run", str(path), common_flags=[
        "--dtype", "float32", "--page-size", str(PAGE), "--pool-tokens", "2048",
        "--poison-freed-pages",
        "--check-page-owners"])
    yield cluster, hf_model, request.param
    cluster.stop()


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_greedy_matches_transformers(served, length):
    cluster, hf_model, spec = served
    prompt = _prompt(length, spec.vocab, seed=length)
    expected = hf_greedy(hf_model, prompt, NEW_TOKENS)
    got = generate(cluster.address, token_ids=prompt, max_tokens=NEW_TOKENS)
    assert got.token_ids == expected
    assert got.completion_tokens == len(expected)
    cluster.assert_pools_at_baseline()


def test_concurrent_batch_matches_transformers(served):
    cluster, hf_model, spec = served
    prompts = [_prompt(PROMPT_LENGTHS[i % 3] + i, spec.vocab, seed=100 + i) for i in range(8)]
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(lambda p: generate(cluster.address, token_ids=p,
                                               max_tokens=NEW_TOKENS), prompts))
    assert [g.token_ids for g in got] == expected
    assert cluster.decode.stats().counters["decode_steps"] > 0
    cluster.assert_pools_at_baseline()
