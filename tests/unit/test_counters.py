"""Counters bumped on several threads lose no increment, and every /metrics scrape exports
every counter, however busy the threads that add them."""

from __future__ import annotations

import sys
import threading
import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.counters import Counters
from common.metrics import ServiceMetrics

THREADS, ADDS = 8, 20_000
NEW_EVENTS = 2_000


@pytest.fixture
def eager_switching():
    """Threads switch every microsecond, so a read-modify-write that is not atomic loses
    increments in every run instead of now and then."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _hammer(target, *args) -> None:
    threads = [threading.Thread(target=target, args=args) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_increments_from_many_threads_are_all_counted(eager_switching):
    counters = Counters()

    def add() -> None:
        for _ in range(ADDS):
            counters.add("decode_steps")

    _hammer(add)
    assert counters.get("decode_steps") == THREADS * ADDS
    assert counters.snapshot() == {"decode_steps": THREADS * ADDS}


def _exported(metrics: ServiceMetrics) -> dict[str, float]:
    body = generate_latest(metrics.registry).decode()
    return {s.labels["event"]: s.value for family in text_string_to_metric_families(body)
            for s in family.samples if s.name == "kvhandoff_engine_events_total"}


def test_every_scrape_exports_every_counter_while_a_thread_adds_new_ones(eager_switching):
    counters = Counters()
    metrics = ServiceMetrics("prefill", lambda: 1, lambda: 1, lambda: 0, lambda: 0,
                             counters=counters)
    added: list[str] = []

    def add_new_events() -> None:  # paced, so that it keeps adding while scrapes run
        for n in range(NEW_EVENTS):
            counters.add(f"event_{n}")
            added.append(f"event_{n}")
            time.sleep(0.0001)

    writer = threading.Thread(target=add_new_events)
    writer.start()
    scrapes = 0
    try:
        while writer.is_alive() or scrapes == 0:
            known = list(added)  # counted before this scrape began: it must show them all
            exported = _exported(metrics)
            assert set(known) <= set(exported), sorted(set(known) - set(exported))[:5]
            scrapes += 1
    finally:
        writer.join()
    assert _exported(metrics) == {f"event_{n}": 1 for n in range(NEW_EVENTS)}
