"""Small helpers for the perf tests: demo-model prompts, and a pair beside a plain decode."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

from tests.helpers.cluster import start_cluster, start_service

DEMO_VOCAB = 98  # the demo model's character vocabulary


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, DEMO_VOCAB) for _ in range(length)]



def pair_and_plain(root: Path, flags: list[str], decode_flags: list[str]) -> Iterator[tuple]:
    """A fixture's body: yields (a demo pair whose decode has decode_flags, a plain decode on
    the same prefill), both with flags, and stops both after."""
    pair = start_cluster(root / "pair", "demo", common_flags=flags, decode_flags=decode_flags)
    try:
        plain = start_service("decode", root / "plain", ["--model", "demo", "--prefill",
                                                         pair.prefill.address, *flags])
    except Exception:
        pair.stop()
        raise
    yield pair, plain
    plain.stop()
    pair.stop()
