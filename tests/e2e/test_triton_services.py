"""Both services on --kernels triton (interpreted on the CPU) generate exactly what they
generate on --kernels torch: several prompt lengths and a concurrent batch."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.helpers.checkpoints import TinySpec, make_checkpoint
from tests.helpers.cluster import generate, start_cluster

pytestmark = pytest.mark.slow
SPEC = TinySpec("llama-triton", "llama", num_heads=4, num_kv_heads=1, tied=False, vocab=128)
LENGTHS = [1, 5, 17, 40]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(SPEC, tmp_path_factory.mktemp("ckpt"))
    return path


def _outputs(cluster, prompts):
    solo = [generate(cluster.address, token_ids=p, max_tokens=NEW_TOKENS,
                     ignore_eos=True).token_ids for p in prompts]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        batch = list(pool.map(lambda p: generate(cluster.address, token_ids=p,
                                                 max_tokens=NEW_TOKENS, ignore_eos=True).token_ids,
                              prompts))
    cluster.assert_pools_at_baseline()
    return solo, batch


def test_triton_and_torch_services_agree(checkpoint, tmp_path):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, SPEC.vocab) for _ in range(n)] for n in LENGTHS]
    results = {}
    for kernels in ("torch", "triton"):
        cluster = start_cluster(tmp_path / kernels, str(checkpoint), common_flags=[
            "--kernels", kernels, "--dtype", "float32", "--page-size", "16",
            "--pool-tokens", "1024",
            "--poison-freed-pages", "--check-page-owners"])
        try:
            results[kernels] = _outputs(cluster, prompts)
            if kernels == "triton":
                for service in (cluster.prefill, cluster.decode):
                    assert '"kernels": "triton"' in service.log_text()
                    interpreted = "triton_interpreted" in service.log_text()
                    assert interpreted == (not torch.cuda.is_available())
        finally:
            cluster.stop()
    torch_solo, torch_batch = results["torch"]
    triton_solo, triton_batch = results["triton"]
    assert torch_solo == torch_batch
    assert triton_solo == torch_solo
    assert triton_batch == torch_batch
