"""Chunked prefill through real processes: a prompt 8x prefill's chunk budget hands off and
generates exactly what an unchunked prefill gives, and what transformers gives; with a short
prompt sharing the passes, each output equals its solo run."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.checkpoints import FAMILY_SPECS, hf_greedy, make_checkpoint
from tests.helpers.cluster import generate, start_cluster

pytestmark = pytest.mark.slow

SPEC = FAMILY_SPECS[0]  # 1024 positions, llama3 rope scaling past 128
CHUNK = 64
LONG = 8 * CHUNK + 17
NEW_TOKENS = 12
COMMON = ["--dtype", "float32", "--page-size", "16", "--pool-tokens", "2048",
          "--max-context-tokens", "1024", "--poison-freed-pages", "--check-page-owners"]


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunked")
    path, hf_model = make_checkpoint(SPEC, root)
    whole = start_cluster(root / "whole", str(path), common_flags=COMMON,
                          prefill_flags=["--prefill-chunk-tokens", "4096"])
    try:
        chunked = start_cluster(root / "chunked", str(path), common_flags=COMMON,
                                prefill_flags=["--prefill-chunk-tokens", str(CHUNK)])
    except Exception:
        whole.stop()
        raise
    yield whole, chunked, hf_model
    chunked.stop()
    whole.stop()


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, SPEC.vocab) for _ in range(n)]


def _passes(cluster) -> int:
    return cluster.prefill.stats().counters.get("forward_passes", 0)


def test_long_prompt_chunked_generates_what_unchunked_and_transformers_do(clusters):
    whole, chunked, hf_model = clusters
    prompt = _prompt(LONG, seed=1)
    before = (_passes(whole), _passes(chunked))
    expected = hf_greedy(hf_model, prompt, NEW_TOKENS)
    got_whole = generate(whole.address, token_ids=prompt, max_tokens=NEW_TOKENS)
    got_chunked = generate(chunked.address, token_ids=prompt, max_tokens=NEW_TOKENS)
    assert got_chunked.token_ids == got_whole.token_ids == expected
    assert _passes(whole) - before[0] == 1
    assert _passes(chunked) - before[1] == 9  # 8 chunks of 64 and one of 17
    chunked.assert_pools_at_baseline()
    whole.assert_pools_at_baseline()


def test_long_and_short_prompts_sharing_passes_equal_their_solo_runs(clusters):
    _, chunked, _ = clusters
    prompts = [_prompt(LONG, seed=2), _prompt(40, seed=3), _prompt(3 * CHUNK + 1, seed=4)]
    solo = [generate(chunked.address, token_ids=p, max_tokens=NEW_TOKENS).token_ids
            for p in prompts]
    with ThreadPoolExecutor(max_workers=3) as pool:
        got = list(pool.map(lambda p: generate(chunked.address, token_ids=p,
                                               max_tokens=NEW_TOKENS).token_ids, prompts))
    assert got == solo
    chunked.assert_pools_at_baseline()
