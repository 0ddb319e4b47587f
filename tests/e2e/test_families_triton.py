"""A Qwen3 checkpoint (per-head q/k RMSNorm, head_dim independent of hidden / heads) with yarn
rope scaling, served on --kernels triton (interpreted on the CPU), generates greedily exactly
what transformers does: short prompts solo and concurrent, and one prompt of 700 tokens (past
original_max_position_embeddings, so the scaled table and the attention factor decide).
Kept small (one layer, two query heads): interpreted Triton is slow, so the handoff and request
deadlines are generous for a loaded machine."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.checkpoints import TinySpec, hf_greedy, make_checkpoint
from tests.helpers.cluster import generate, start_cluster

pytestmark = pytest.mark.slow

SPEC = TinySpec("qwen3-yarn-triton", "qwen3", num_heads=2, num_kv_heads=1, tied=False,
                head_dim=16, hidden=32, layers=1, vocab=256, max_positions=1024,
                rope={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128})
SHORT = [1, 16, 21]
LONG = 700
NEW_TOKENS = 4


def test_qwen3_yarn_on_triton_matches_transformers(tmp_path):
    path, hf_model = make_checkpoint(SPEC, tmp_path)
    rng = random.Random(13)
    prompts = [[rng.randrange(3, SPEC.vocab) for _ in range(n)] for n in SHORT + [LONG]]
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    cluster = start_cluster(tmp_path / "run", str(path), common_flags=[
        "--kernels", "triton", "--dtype", "float32", "--page-size", "16",
        "--pool-tokens", "2048", "--check-page-owners"],
        decode_flags=["--handoff-timeout-s", "600"])
    try:
        assert '"kernels": "triton"' in cluster.decode.log_text()
        def run(p):
            return generate(cluster.address, token_ids=p, max_tokens=NEW_TOKENS,
                            timeout=600).token_ids
        assert [run(p) for p in prompts] == expected
        with ThreadPoolExecutor(max_workers=len(SHORT)) as pool:
            assert list(pool.map(run, prompts[:len(SHORT)])) == expected[:len(SHORT)]
        cluster.assert_pools_at_baseline()
    finally:
        cluster.stop()
