"""Small helpers for the perf tests: demo-model prompts and polling a service's stats."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

DEMO_VOCAB = 98  # the demo model's character vocabulary


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, DEMO_VOCAB) for _ in range(length)]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Polls until predicate() holds; fails the test after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.05)
