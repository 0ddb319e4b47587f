"""`--local-prefill` (the one-process baseline of the benchmarks) generates exactly what the
disaggregated pair generates: greedy and seeded sampling, short and multi-chunk prompts."""

from __future__ import annotations

import pytest

from tests.helpers.cluster import generate, start_cluster, start_service
from tests.perf.helpers import prompt

pytestmark = pytest.mark.slow

FLAGS = ["--page-size", "16", "--pool-tokens", "2048", "--max-context-tokens", "1024",
         "--poison-freed-pages", "--check-page-owners"]
# 700 tokens of demo KV are 700 KiB per layer: with a 256 KiB chunk limit, 3 chunks per layer
PAIR_DECODE = ["--max-chunk-bytes", str(256 << 10)]


@pytest.fixture(scope="module")
def modes(tmp_path_factory):
    root = tmp_path_factory.mktemp("local_prefill")
    pair = start_cluster(root / "pair", "demo", common_flags=FLAGS, decode_flags=PAIR_DECODE)
    try:
        local = start_service("decode", root / "local", ["--model", "demo", "--local-prefill",
                                                         *FLAGS])
    except Exception:
        pair.stop()
        raise
    yield pair, local
    local.stop()
    pair.stop()


@pytest.mark.parametrize("length", [1, 16, 53, 700])
def test_greedy_tokens_equal_disaggregated(modes, length):
    pair, local = modes
    ids = prompt(length, seed=length)
    disaggregated = generate(pair.address, token_ids=ids, max_tokens=24, ignore_eos=True)
    one_process = generate(local.address, token_ids=ids, max_tokens=24, ignore_eos=True)
    assert len(disaggregated.token_ids) == 24
    assert one_process.token_ids == disaggregated.token_ids
    pair.assert_pools_at_baseline()
    pool = local.stats().pool
    assert pool.pages_free == pool.pages_total


def test_seeded_sampling_equals_disaggregated(modes):
    pair, local = modes
    ids = prompt(40, seed=99)
    kwargs = dict(max_tokens=20, ignore_eos=True, temperature=0.9, top_k=20, seed=1234)
    assert (generate(local.address, token_ids=ids, **kwargs).token_ids
            == generate(pair.address, token_ids=ids, **kwargs).token_ids)


def test_local_mode_computes_the_prompt_itself(modes):
    pair, local = modes
    before = local.stats().counters.get("local_prefills", 0)
    generate(local.address, token_ids=prompt(9, seed=5), max_tokens=2)
    assert local.stats().counters["local_prefills"] == before + 1
    assert "local_prefills" not in pair.decode.stats().counters
