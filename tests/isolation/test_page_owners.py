"""--check-page-owners: a sequence whose page table is tampered with fails alone with
PAGE_OWNERSHIP_VIOLATION before its step reads; every other sequence finishes exactly as it would
alone, and the pool ends at its baseline."""

from __future__ import annotations

import random

import grpc
import pytest

from common.kvpool.kv_cache import PoolConfig
from decode_svc.sequence import FailedEvent, FinishedEvent, Sequence, TokenEvent
from tests.isolation.inproc import Harness

PAGE = 4
TAMPER_AT = 2  # the target's token index at which its state is tampered with
PROMPT_LEN = 3 * PAGE + 2  # past page 0, so the target never writes into a tampered page 0


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 97) for _ in range(PROMPT_LEN + i)] for i in range(count)]


def _foreign_page(victims: dict[str, Sequence]):
    def tamper(seq: Sequence) -> None:
        seq.pages[0] = next(iter(victims.values())).pages[0]
    return tamper


def _free_page(harness: Harness):
    def tamper(seq: Sequence) -> None:
        alloc = harness.pool.allocator
        seq.pages[0] = next(p for p in range(alloc.num_pages) if alloc.owner_of(p) is None)
    return tamper


def _out_of_order(seq: Sequence) -> None:
    seq.pages[0], seq.pages[1] = seq.pages[1], seq.pages[0]


def _beyond_written(seq: Sequence) -> None:
    seq.tokens.append(seq.tokens[-1])  # the next step would read a slot nobody wrote


def _beyond_table(seq: Sequence) -> None:
    next_pos = len(seq.tokens) - 1
    del seq.pages[next_pos // PAGE:]  # the table ends right before the slot the step writes


TAMPERS = ["foreign_page", "free_page", "out_of_order", "beyond_written", "beyond_table"]


def _tamper(kind: str, harness: Harness, victims: dict[str, Sequence]):
    return {"foreign_page": _foreign_page(victims), "free_page": _free_page(harness),
            "out_of_order": _out_of_order, "beyond_written": _beyond_written,
            "beyond_table": _beyond_table}[kind]


@pytest.fixture
def harness():
    h = Harness(PoolConfig(pool_tokens=64 * PAGE, page_size=PAGE, poison_freed=True,
                           check_owners=True))
    yield h
    h.close()


def _run_with_tamper(harness: Harness, kind: str):
    prompts = _prompts(4, seed=hash(kind) % 1000)
    max_tokens = 12
    solo = [harness.solo(p, max_tokens) for p in prompts]
    victims: dict[str, Sequence] = {}
    for i, prompt in enumerate(prompts[1:], start=1):
        victims[f"victim-{i}"] = harness.submit(f"victim-{i}", prompt, max_tokens)
    tamper = _tamper(kind, harness, victims)

    def hook(seq: Sequence, event) -> None:
        if isinstance(event, TokenEvent) and event.index == TAMPER_AT:
            tamper(seq)

    harness.submit("target", prompts[0], max_tokens, hook=hook)
    return prompts, solo, victims


@pytest.mark.parametrize("kind", TAMPERS)
def test_tampered_page_table_fails_that_request_alone(harness, kind):
    prompts, solo, victims = _run_with_tamper(harness, kind)
    target = harness.wait("target")
    assert isinstance(target.end, FailedEvent), target.end
    assert target.end.error.reason == "PAGE_OWNERSHIP_VIOLATION"
    assert target.end.error.code == grpc.StatusCode.INTERNAL
    # tokens up to the tamper are the solo ones; none came after it
    assert target.tokens == solo[0][: TAMPER_AT + 1]
    for i, name in enumerate(victims, start=1):
        outcome = harness.wait(name)
        assert isinstance(outcome.end, FinishedEvent), (name, outcome.end)
        assert outcome.tokens == solo[i], name
    violations = harness.log.events("page_ownership_violation")
    assert [v["request_id"] for v in violations] == ["target"]
    assert harness.pages_free() == (64, 64)
    harness.pool.allocator.check_invariants()
    # the engine keeps serving, exactly
    assert harness.solo(prompts[0], 5) == solo[0][:5]


def test_without_the_check_a_tampered_table_goes_unnoticed():
    """The same tamper with --no-check-page-owners is not caught: the check is what catches it."""
    h = Harness(PoolConfig(pool_tokens=64 * PAGE, page_size=PAGE, check_owners=False))
    try:
        _, _, victims = _run_with_tamper(h, "foreign_page")
        assert isinstance(h.wait("target").end, FinishedEvent)
        for name in victims:
            h.wait(name)
        assert h.log.events("page_ownership_violation") == []
    finally:
        h.close()
