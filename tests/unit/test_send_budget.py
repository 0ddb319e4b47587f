"""The prefill send budget bounds bytes computed but not yet sent, and never deadlocks on a
stream that went away. Each test that is about waiting first sees the engine's thread inside
its wait (`SendBudget.waiting`), however late that thread starts, before it lets it go."""

from __future__ import annotations

import threading

from prefill_svc.send_budget import JobBytes, SendBudget
from tests.helpers.polling import wait_until


def _until_waiting(budget: SendBudget) -> None:
    wait_until(lambda: budget.waiting == 1, 10, "the engine thread waits for room")


def test_engine_waits_while_over_budget_and_resumes_on_release():
    budget = SendBudget(limit_bytes=100)
    job, cancelled = JobBytes(), threading.Event()
    assert budget.acquire(job, 60, cancelled)
    admitted = threading.Event()
    worker = threading.Thread(target=lambda: budget.acquire(job, 60, cancelled) and admitted.set())
    worker.start()
    _until_waiting(budget)
    assert not admitted.is_set() and budget.pending == 60  # 120 would exceed 100
    budget.release(job, 60)
    worker.join(timeout=5)
    assert admitted.is_set() and budget.pending == 60 and job.held == 60


def test_a_chunk_larger_than_the_budget_passes_when_nothing_is_pending():
    budget = SendBudget(limit_bytes=10)
    assert budget.acquire(JobBytes(), 1000, threading.Event())


def test_closing_a_stream_returns_its_bytes_and_frees_a_waiting_engine():
    budget = SendBudget(limit_bytes=100)
    slow, other = JobBytes(), JobBytes()
    assert budget.acquire(slow, 90, threading.Event())
    result: list[bool] = []
    worker = threading.Thread(target=lambda: result.append(
        budget.acquire(other, 50, threading.Event())))
    worker.start()
    _until_waiting(budget)
    budget.close(slow)  # the slow reader's stream ended with 90 bytes never sent
    worker.join(timeout=5)
    assert result == [True] and budget.pending == 50
    assert not budget.acquire(slow, 1, threading.Event())  # a closed job acquires nothing


def test_a_cancelled_job_stops_waiting():
    budget = SendBudget(limit_bytes=100)
    assert budget.acquire(JobBytes(), 100, threading.Event())
    cancelled = threading.Event()
    result: list[bool] = []
    worker = threading.Thread(target=lambda: result.append(
        budget.acquire(JobBytes(), 10, cancelled)))
    worker.start()
    _until_waiting(budget)
    cancelled.set()
    worker.join(timeout=5)
    assert result == [False] and budget.waiting == 0
