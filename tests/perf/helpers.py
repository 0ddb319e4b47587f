"""Small helpers for the perf tests: demo-model prompts."""

from __future__ import annotations

import random

DEMO_VOCAB = 98  # the demo model's character vocabulary


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, DEMO_VOCAB) for _ in range(length)]

