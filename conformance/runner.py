"""Running a list of cases one at a time: selection, timing, not-applicable cases, and the pool
check after each case (nothing a case did may stay behind in the peer's pool)."""

from __future__ import annotations

import random
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from conformance.report import CaseResult, Outcome, Selection

T = TypeVar("T")


class NotApplicable(Exception):
    """The case cannot apply to this target (e.g. its pool is as large as its window)."""


@dataclass(frozen=True)
class Case(Generic[T]):
    """run(target) returns the problems it found; an empty list passes."""

    case_id: str
    rule: str
    level: str
    expectation: str
    run: Callable[[T], Awaitable[list[str]]]


def prompt_ids(length: int, vocab_size: int, seed: int) -> list[int]:
    """A deterministic prompt of in-vocabulary ids, avoiding the low ids models reserve."""
    low = 3 if vocab_size > 3 else 0
    rng = random.Random(seed)
    return [rng.randrange(low, vocab_size) for _ in range(length)]


async def run_cases(cases: list[Case[T]], target: T, selection: Selection,
                    settle: Callable[[], Awaitable[str | None]],
                    progress: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
    """Runs the selected cases in order; `settle` returns a pool problem or None after each."""
    results = []
    for case in cases:
        if not selection.wants(case.case_id):
            continue
        started = time.monotonic()
        try:
            problems = await case.run(target)
        except NotApplicable as why:
            result = CaseResult(case.case_id, case.rule, case.level, case.expectation,
                                Outcome.SKIP, f"not applicable: {why}")
            results.append(result)
            if progress:
                progress(result)
            continue
        except Exception as exc:  # a crash in a case is that case's failure, not the run's
            problems = [f"case raised {type(exc).__name__}: {exc}",
                        traceback.format_exc(limit=3).strip().splitlines()[-1]]
        leak = await settle()
        if leak:
            problems = [*problems, f"[G-07] {leak}"]
        result = CaseResult(case.case_id, case.rule, case.level, case.expectation,
                            Outcome.FAIL if problems else Outcome.PASS, "; ".join(problems),
                            time.monotonic() - started)
        results.append(result)
        if progress:
            progress(result)
    return results
