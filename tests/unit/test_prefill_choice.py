"""The choice of prefill replica (decode_svc/prefill_choice.py) and the replica breaker
(decode_svc/prefill_breaker.py): rendezvous is stable and spreads scopes, a replica's leaving
moves only its own scopes, a busy favourite gives way to the least loaded, unscoped requests go
by load; the breaker ejects after consecutive failures, cools down, and gives one trial."""

from __future__ import annotations

import collections

import pytest

from decode_svc.prefill_breaker import BreakerConfig, BreakerState, CircuitBreaker
from decode_svc.prefill_choice import (Candidate, PrefixAwareChooser, RoundRobinChooser,
                                       make_chooser, route_key)

PAGE = 4
NAMES = ["127.0.0.21:50061", "127.0.0.22:50061", "127.0.0.23:50061"]


def idle(names=NAMES, load=None) -> list[Candidate]:
    load = load or {}
    return [Candidate(name, load.get(name, 0)) for name in names]


def key(scope: str, first=(1, 2, 3, 4), rest=()) -> bytes:
    return route_key(scope.encode(), [*first, *rest], PAGE)


def test_route_key_is_scope_and_first_page_only():
    assert key("a", rest=(9, 9)) == key("a", rest=(7,))  # later tokens do not move a request
    assert key("a") != key("b")
    assert key("a") != key("a", first=(1, 2, 3, 5))
    assert route_key(b"", [1, 2, 3, 4, 5], PAGE) is None  # unscoped: by load
    assert route_key(b"s", [1, 2, 3], PAGE) is None  # under a page: nothing cacheable


def test_rendezvous_is_stable_and_order_free():
    chooser = PrefixAwareChooser()
    for scope in ("tenant-a", "tenant-b", "tenant-c"):
        first = chooser.choose(key(scope), idle())
        assert all(chooser.choose(key(scope), idle()) == first for _ in range(20))
        assert chooser.choose(key(scope), idle(list(reversed(NAMES)))) == first
        assert PrefixAwareChooser().choose(key(scope), idle()) == first  # another decode agrees


def test_rendezvous_spreads_scopes():
    chooser = PrefixAwareChooser()
    counts = collections.Counter(chooser.choose(key(f"scope-{i}"), idle()) for i in range(300))
    assert set(counts) == set(NAMES)
    assert min(counts.values()) >= 60, counts  # 100 each expected


def test_a_replica_leaving_moves_only_its_own_scopes():
    chooser = PrefixAwareChooser()
    keys = [key(f"scope-{i}") for i in range(200)]
    before = {k: chooser.choose(k, idle()) for k in keys}
    gone = NAMES[1]
    after = {k: chooser.choose(k, idle([n for n in NAMES if n != gone])) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == gone for k in moved)
    assert all(after[k] != gone for k in keys)


def test_busy_favourite_falls_back_to_least_loaded():
    chooser = PrefixAwareChooser(busy_slack=4)
    k = key("hot")
    favourite = chooser.choose(k, idle())
    others = [n for n in NAMES if n != favourite]
    assert chooser.choose(k, idle(load={favourite: 3})) == favourite  # 3 < slack: still it
    busy = {favourite: 4, others[0]: 2, others[1]: 0}
    assert chooser.choose(k, idle(load=busy)) == others[1]
    # equals: the one ranked higher for this key, so the overflow also meets one cache
    tied = chooser.choose(k, idle(load={favourite: 9}))
    assert tied in others
    assert all(chooser.choose(k, idle(load={favourite: 9})) == tied for _ in range(5))


def test_unscoped_requests_go_by_load():
    chooser = PrefixAwareChooser()
    assert chooser.choose(None, idle(load={NAMES[0]: 5, NAMES[1]: 1, NAMES[2]: 2})) == NAMES[1]
    spread = collections.Counter(chooser.choose(None, idle()) for _ in range(30))
    assert spread == {name: 10 for name in NAMES}  # idle replicas take turns


def test_only_candidates_are_chosen():
    chooser = PrefixAwareChooser()
    for i in range(50):
        assert chooser.choose(key(f"s{i}"), idle(NAMES[:1])) == NAMES[0]
    assert chooser.choose(key("s"), []) is None
    assert RoundRobinChooser().choose(None, []) is None


def test_round_robin_ignores_the_key():
    chooser = make_chooser("round-robin")
    picks = [chooser.choose(key("same"), idle()) for _ in range(6)]
    assert collections.Counter(picks) == {name: 2 for name in NAMES}
    with pytest.raises(ValueError, match="unknown prefill choice"):
        make_chooser("random")
    with pytest.raises(ValueError, match="busy_slack"):
        PrefixAwareChooser(0)


def test_breaker_ejects_after_consecutive_failures_then_trials():
    breaker = CircuitBreaker(BreakerConfig(failures_to_eject=3, cool_down_s=10.0))
    assert not breaker.failed(0.0) and not breaker.failed(1.0)
    breaker.succeeded()  # a success resets the count
    assert not breaker.failed(2.0) and not breaker.failed(2.0)
    assert breaker.failed(2.0)  # third in a row
    assert breaker.state == BreakerState.OPEN and breaker.ejections == 1
    assert not breaker.allows(11.9)
    assert breaker.allows(12.0) and breaker.state == BreakerState.HALF_OPEN
    breaker.started()
    assert not breaker.allows(12.5)  # one trial at a time
    assert breaker.failed(13.0)  # the trial failed: open again, a second ejection
    assert breaker.ejections == 2 and not breaker.allows(22.9)
    assert breaker.allows(23.0)
    breaker.started()
    breaker.succeeded()
    assert breaker.state == BreakerState.CLOSED and breaker.allows(23.0)


def test_breaker_trial_ended_by_the_client_allows_another():
    breaker = CircuitBreaker(BreakerConfig(failures_to_eject=1, cool_down_s=1.0))
    assert breaker.failed(0.0)
    assert breaker.allows(1.0)
    breaker.started()
    breaker.ended_unjudged()
    assert breaker.allows(1.0) and breaker.state == BreakerState.HALF_OPEN
    with pytest.raises(ValueError):
        CircuitBreaker(BreakerConfig(failures_to_eject=0))
