"""Bounded polling for tests: wait for a condition that another process or thread makes true.
One wait for synchronous tests (`wait_until`) and one for coroutines (`await_until`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

POLL_SECONDS = 0.05


def _describe(what: str | Callable[[], str]) -> str:
    return what() if callable(what) else what


def wait_until(predicate: Callable[[], bool], timeout: float,
               what: str | Callable[[], str]) -> None:
    """Polls until predicate() holds; fails the test after timeout seconds. `what` names the
    condition (a callable is asked only on failure, so it can report the state then)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {_describe(what)}")
        time.sleep(POLL_SECONDS)


async def await_until(predicate: Callable[[], bool], timeout: float,
                      what: str | Callable[[], str]) -> None:
    """wait_until for a coroutine: polls without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {_describe(what)}")
        await asyncio.sleep(POLL_SECONDS / 10)


def assert_holds(predicate: Callable[[], bool], seconds: float,
                 what: str | Callable[[], str]) -> None:
    """Checks predicate() again and again for `seconds`: a condition that must not lapse
    (the opposite of wait_until, which waits for it to start)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert predicate(), f"lapsed within {seconds}s: {_describe(what)}"
        time.sleep(POLL_SECONDS)
