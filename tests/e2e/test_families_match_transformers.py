"""Each supported family (Llama 3.x rope scaling llama3 / yarn / linear, Mistral, Qwen3), served
disaggregated, generates greedily exactly what transformers' generate(do_sample=False) does:
prompts of 1 token, one page, pages plus a remainder and >= 700 tokens (far past the
original_max_position_embeddings of 128, so the rope scaling decides the tokens), solo and in
one concurrent batch."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.checkpoints import FAMILY_SPECS, hf_greedy, make_checkpoint
from tests.helpers.cluster import generate, start_cluster

pytestmark = pytest.mark.slow

PAGE = 16
LENGTHS = [1, PAGE, 3 * PAGE + 5, 720]
NEW_TOKENS = 8


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


@pytest.mark.parametrize("spec", FAMILY_SPECS, ids=lambda s: s.name)
def test_family_matches_transformers_solo_and_concurrent(spec, tmp_path):
    path, hf_model = make_checkpoint(spec, tmp_path)
    prompts = [_prompt(n, spec.vocab, seed=n) for n in LENGTHS]
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    cluster = start_cluster(tmp_path / "run", str(path), common_flags=[
        "--dtype", "float32", "--page-size", str(PAGE), "--pool-tokens", "4096",
        "--check-page-owners"])
    try:
        solo = [generate(cluster.address, token_ids=p, max_tokens=NEW_TOKENS).token_ids
                for p in prompts]
        assert solo == expected
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            batch = list(pool.map(lambda p: generate(cluster.address, token_ids=p,
                                                     max_tokens=NEW_TOKENS).token_ids, prompts))
        assert batch == expected
        cluster.assert_pools_at_baseline()
    finally:
        cluster.stop()
