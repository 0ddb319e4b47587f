"""The queue-depth rule of conditional disaggregation (`--local-prefill-queue-depth`): with a
prompt already at prefill, decode prefills the next one itself, in chunks between its steps;
every prompt of a burst, whichever way it went, generates exactly what a plain decode on the
same prefill generates, each went exactly one way, and the pools return to their baseline."""

from __future__ import annotations

import threading

import pytest

from tests.helpers.cluster import generate
from tests.helpers.polling import wait_until
from tests.perf.helpers import pair_and_plain, prompt

pytestmark = pytest.mark.slow

FLAGS = ["--page-size", "16", "--pool-tokens", "8192", "--max-context-tokens", "1024",
         "--poison-freed-pages", "--check-page-owners"]
BURST = 6
PROMPT_TOKENS = 600  # long enough that the first is still at prefill when the next arrives


@pytest.fixture(scope="module")
def decodes(tmp_path_factory):
    """(the pair whose decode takes prompts from prefill's queue, a plain decode on the same
    prefill)."""
    yield from pair_and_plain(tmp_path_factory.mktemp("queue_depth"), FLAGS,
                              ["--local-prefill-queue-depth", "1",
                               "--local-prefill-chunk-tokens", "64"])


def _counts(pair) -> tuple[int, int, int]:
    """(prompts decode kept, of them taken from prefill's queue, handoffs prefill completed)."""
    counters = pair.decode.stats().counters
    return (counters.get("prefills_kept_local", 0), counters.get("prefills_taken_from_queue", 0),
            pair.prefill.stats().counters.get("handoffs_completed", 0))


def test_a_burst_shares_its_prompts_and_generates_what_the_plain_pair_does(decodes):
    pair, plain = decodes
    prompts = [prompt(PROMPT_TOKENS + i, seed=60 + i) for i in range(BURST)]
    kept, taken, handed = _counts(pair)
    passes = pair.decode.stats().counters.get("local_prefill_passes", 0)
    start = threading.Barrier(BURST)
    results: dict[int, object] = {}

    def one(i: int) -> None:
        start.wait()
        results[i] = generate(pair.address, token_ids=prompts[i], max_tokens=16,
                              ignore_eos=True)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(BURST)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert sorted(results) == list(range(BURST))
    wait_until(lambda: _counts(pair)[0] + _counts(pair)[2] == kept + handed + BURST, 10,
               lambda: f"each prompt kept or handed off once: {_counts(pair)} after "
                       f"{(kept, taken, handed)}")
    now_kept, now_taken, now_handed = _counts(pair)
    assert now_taken > taken, "no prompt was taken from prefill's queue"
    assert now_handed > handed, "every prompt stayed: the rule takes one at a time"
    assert now_kept - kept == now_taken - taken  # no idle rule here: only the depth rule keeps
    chunks = -(-PROMPT_TOKENS // 64)  # at least this many passes each: they went in chunks
    assert (pair.decode.stats().counters["local_prefill_passes"] - passes
            >= chunks * (now_taken - taken))
    for i, ids in enumerate(prompts):
        theirs = generate(plain.address, token_ids=ids, max_tokens=16, ignore_eos=True)
        assert len(results[i].token_ids) == 16 and results[i].token_ids == theirs.token_ids, i
    pair.assert_pools_at_baseline()
