"""Conditional disaggregation (`--local-prefill-max-tokens`): a short prompt that finds decode
idle is prefilled by decode itself, with no handoff, and generates exactly what the plain pair
generates; a longer prompt, or a short one while decode is busy, goes to prefill through the
unchanged receiver chain; a threshold past decode's own capacity refuses to start."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from tests.helpers.cluster import REPO, generate
from tests.helpers.polling import wait_until
from tests.perf.helpers import pair_and_plain, prompt

pytestmark = pytest.mark.slow

FLAGS = ["--page-size", "16", "--pool-tokens", "4096", "--max-context-tokens", "1024",
         "--poison-freed-pages", "--check-page-owners"]
THRESHOLD = 32


@pytest.fixture(scope="module")
def decodes(tmp_path_factory):
    """(the pair whose decode keeps short prompts, a plain decode on the same prefill)."""
    yield from pair_and_plain(tmp_path_factory.mktemp("conditional"), FLAGS,
                              ["--local-prefill-max-tokens", str(THRESHOLD)])


def _counts(pair) -> tuple[int, int]:
    """(prompts decode kept, handoffs prefill completed)."""
    return (pair.decode.stats().counters.get("prefills_kept_local", 0),
            pair.prefill.stats().counters.get("handoffs_completed", 0))


@pytest.mark.parametrize("length", [1, 17, THRESHOLD])
def test_a_short_prompt_at_an_idle_decode_is_prefilled_there(decodes, length):
    pair, plain = decodes
    ids = prompt(length, seed=length)
    kept, handed = _counts(pair)
    mine = generate(pair.address, token_ids=ids, max_tokens=24, ignore_eos=True)
    assert _counts(pair) == (kept + 1, handed)  # no handoff: prefill never saw it
    theirs = generate(plain.address, token_ids=ids, max_tokens=24, ignore_eos=True)
    assert len(mine.token_ids) == 24 and mine.token_ids == theirs.token_ids
    pair.assert_pools_at_baseline()


def test_a_longer_prompt_is_handed_off_and_checked(decodes):
    pair, plain = decodes
    ids = prompt(THRESHOLD + 1, seed=7)
    kept, handed = _counts(pair)
    mine = generate(pair.address, token_ids=ids, max_tokens=16, ignore_eos=True)
    wait_until(lambda: _counts(pair) == (kept, handed + 1), 10,
               lambda: f"one handoff, none kept: {_counts(pair)} after {(kept, handed)}")
    assert mine.token_ids == generate(plain.address, token_ids=ids, max_tokens=16,
                                      ignore_eos=True).token_ids
    pair.assert_pools_at_baseline()


def test_a_short_prompt_while_decode_is_busy_is_handed_off(decodes):
    pair, _ = decodes
    long_run: list = []
    runner = threading.Thread(target=lambda: long_run.append(generate(
        pair.address, token_ids=prompt(THRESHOLD + 8, seed=3), max_tokens=900,
        ignore_eos=True)))
    runner.start()
    try:
        steps = lambda: pair.decode.stats().counters.get("decode_steps", 0)  # noqa: E731
        first = steps()
        wait_until(lambda: steps() > first + 5, 30, "the long generation steps")
        kept, handed = _counts(pair)
        short = generate(pair.address, token_ids=prompt(8, seed=8), max_tokens=4, ignore_eos=True)
        assert not long_run, "the long generation ended first: inconclusive"
        wait_until(lambda: _counts(pair)[1] == handed + 1, 10, "the short prompt's handoff")
        assert _counts(pair)[0] == kept
        assert len(short.token_ids) == 4
    finally:
        runner.join(timeout=120)
    assert len(long_run) == 1 and len(long_run[0].token_ids) == 900
    pair.assert_pools_at_baseline()


def test_a_burst_at_an_idle_decode_generates_what_the_plain_pair_does(decodes):
    """Short prompts arriving together: those that find decode prefilling only its own kept
    prompts stay too (and are packed into shared passes), the rest are handed off; whichever
    way each went, its tokens are the plain decode's and every prompt went exactly one way."""
    pair, plain = decodes
    prompts = [prompt(length, seed=40 + length) for length in (5, 9, 17, 23, 30, THRESHOLD)]
    kept, handed = _counts(pair)
    start = threading.Barrier(len(prompts))
    results: dict[int, object] = {}

    def one(i: int) -> None:
        start.wait()
        results[i] = generate(pair.address, token_ids=prompts[i], max_tokens=12,
                              ignore_eos=True)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(results) == list(range(len(prompts)))
    wait_until(lambda: sum(_counts(pair)) == kept + handed + len(prompts), 10,
               lambda: f"each prompt kept or handed off once: {_counts(pair)} after "
                       f"{(kept, handed)}")
    assert _counts(pair)[0] > kept  # the first of the burst found decode idle
    for i, ids in enumerate(prompts):
        assert results[i].token_ids == generate(plain.address, token_ids=ids, max_tokens=12,
                                                ignore_eos=True).token_ids
    pair.assert_pools_at_baseline()


@pytest.mark.parametrize("flags, says", [
    (["--local-prefill-max-tokens", "5000"], "--local-prefill-max-tokens 5000 exceeds the "
     "longest prompt this decode can prefill itself (1024 tokens)"),
    (["--local-prefill-max-tokens", "16", "--local-prefill"], "--local-prefill-max-tokens with "
     "--local-prefill: --local-prefill already prefills every prompt here"),
    (["--local-prefill-burst-tokens", "256"], "--local-prefill-burst-tokens without "
     "--local-prefill-max-tokens: decode keeps no prompt, so there is no burst to share"),
])
def test_a_threshold_decode_cannot_honour_refuses_to_start(flags, says):
    result = subprocess.run(
        [sys.executable, "-m", "kvhandoff_cli.main", "decode", "--model", "demo", "--port", "0",
         "--max-context-tokens", "1024", *flags],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    everything = result.stdout + result.stderr
    assert result.returncode == 2, everything
    assert "Traceback" not in everything, everything
    assert f"kvhandoff decode: refusing to start: {says}" in result.stderr, everything
