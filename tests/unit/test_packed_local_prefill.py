"""Decode's own prefill packs the prompts queued in one round of engine commands into one pass
(LocalPrefillEngine, pass_tokens): the same first tokens and the same KV in the same pages as a
pass per prompt, a released request is answered and not computed, a failing pass answers every
prompt in it, and the pool returns to its baseline."""

from __future__ import annotations

import threading

import pytest
import torch

from common.counters import Counters
from common.errors import ServiceError
from common.kvpool.kv_cache import PoolConfig
from common.sampling import SamplingConfig
from decode_svc.engine_commands import LocalPrefill
from decode_svc.local_prefill import LocalPrefillEngine, packed_passes
from tests.isolation.inproc import RecordingLog, make_pool, tiny_model

PROMPTS = {"a": [5, 9, 17, 33, 2, 64, 8, 11, 40, 3], "b": [7, 1, 90, 45, 12],
           "c": list(range(20, 57))}  # 10, 5 and 37 tokens: c spans three 16-token pages
GREEDY = SamplingConfig()


class _Answers:
    """Collects done(...) results from the engine thread until `expected` have arrived."""

    def __init__(self, expected: int) -> None:
        self.results: dict[str, object] = {}
        self._expected = expected
        self._all = threading.Event()
        self._lock = threading.Lock()

    def done_for(self, name: str):
        def done(result: object) -> None:
            with self._lock:
                self.results[name] = result
                if len(self.results) >= self._expected:
                    self._all.set()
        return done

    def wait(self) -> dict[str, object]:
        assert self._all.wait(60), f"only {sorted(self.results)} were answered"
        return self.results


def _engine(pass_tokens: int, model=None):
    model = model or tiny_model()
    pool = make_pool(model, PoolConfig(pool_tokens=256, page_size=16))
    counters = Counters()
    engine = LocalPrefillEngine(model, pool, 8, 8, RecordingLog(), counters,
                                pass_tokens=pass_tokens)
    return engine, pool, counters


def _run_round(engine: LocalPrefillEngine, prompts: dict[str, list[int]],
               released: tuple[str, ...] = ()) -> dict[str, object]:
    """Queues every reservation and prefill (and the releases) before the engine thread starts,
    so they all fall in its first round of commands."""
    reserved = _Answers(len(prompts))
    for name, ids in prompts.items():
        engine.reserve(name, len(ids), reserved.done_for(name))
    answers = _Answers(len(prompts))
    for name, ids in prompts.items():
        engine.prefill(name, ids, GREEDY, answers.done_for(name))
    for name in released:
        engine.release(name)
    engine.start()
    reserved.wait()
    return answers.wait()


def _assert_drained_to(engine, pool, baseline: int) -> None:
    """After every command queued so far, the pool has baseline pages free."""
    drained = threading.Event()
    engine.after_writes(drained.set)
    assert drained.wait(30)
    assert pool.allocator.snapshot().pages_free == baseline


def _kv_of(pool, name: str, n: int) -> torch.Tensor:
    slots = torch.tensor(pool.slots_for(pool.allocator.page_table(name), 0, n))
    k = pool.k.flatten(1, 2)[:, slots]  # [L, n, Hkv, D]
    v = pool.v.flatten(1, 2)[:, slots]
    return torch.stack([k, v])  # [2, L, n, Hkv, D]


def _prefill_alone(model, name: str) -> tuple[int, torch.Tensor]:
    engine, pool, _ = _engine(0, model)
    try:
        first = _run_round(engine, {name: PROMPTS[name]})[name]
        return first, _kv_of(pool, name, len(PROMPTS[name]))
    finally:
        engine.stop()


def test_a_round_of_prompts_is_one_pass_with_each_prompt_as_if_alone():
    model = tiny_model(seed=3)
    engine, pool, counters = _engine(1024, model)
    try:
        firsts = _run_round(engine, PROMPTS)
        assert counters.get("local_prefill_passes") == 1
        assert counters.get("local_prefills") == 3
        for name, ids in PROMPTS.items():
            alone_first, alone_kv = _prefill_alone(model, name)
            assert firsts[name] == alone_first, name
            torch.testing.assert_close(_kv_of(pool, name, len(ids)), alone_kv,
                                       rtol=1e-5, atol=1e-5)
    finally:
        engine.stop()


def test_the_pass_budget_cuts_the_round_in_order():
    engine, _, counters = _engine(len(PROMPTS["a"]) + len(PROMPTS["b"]), tiny_model())
    try:
        firsts = _run_round(engine, PROMPTS)
        assert all(isinstance(firsts[n], int) for n in PROMPTS)
        assert counters.get("local_prefill_passes") == 2  # [a, b], then [c]
    finally:
        engine.stop()


def test_packed_passes_keep_the_order_and_never_pass_the_budget():
    commands = [LocalPrefill(str(i), [1] * n, GREEDY, lambda _: None)
                for i, n in enumerate([3, 4, 2, 9, 1])]
    cut = [[c.request_id for c in group] for group in packed_passes(commands, 7)]
    assert cut == [["0", "1"], ["2"], ["3"], ["4"]]  # 9 > 7 alone; 2 + 9 and 9 + 1 pass 7
    assert [len(g) for g in packed_passes(commands, 0)] == [1] * 5
    assert [len(g) for g in packed_passes(commands, 100)] == [5]


def test_a_request_released_before_its_pass_is_answered_and_not_computed():
    engine, pool, counters = _engine(1024, tiny_model())
    baseline = pool.allocator.snapshot().pages_free
    try:
        results = _run_round(engine, PROMPTS, released=("b",))
        assert isinstance(results["b"], ServiceError)
        assert results["b"].reason == "REQUEST_RELEASED"
        assert isinstance(results["a"], int) and isinstance(results["c"], int)
        assert counters.get("local_prefills") == 2
        for name in ("a", "c"):
            engine.release(name)
        _assert_drained_to(engine, pool, baseline)
    finally:
        engine.stop()


def test_a_failing_pass_answers_every_prompt_and_the_engine_keeps_serving(monkeypatch):
    model = tiny_model()
    engine, pool, counters = _engine(1024, model)
    real_prefill = model.prefill
    calls = []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real_prefill(*args, **kwargs)

    monkeypatch.setattr(model, "prefill", fail_once)
    try:
        results = _run_round(engine, PROMPTS)
        assert {n: getattr(r, "reason", r) for n, r in results.items()} == {
            n: "LOCAL_PREFILL_FAILED" for n in PROMPTS}
        assert counters.get("local_prefills") == 0
        again = _Answers(1)
        engine.prefill("a", PROMPTS["a"], GREEDY, again.done_for("a"))
        assert isinstance(again.wait()["a"], int)
    finally:
        engine.stop()


@pytest.mark.parametrize("pass_tokens", [0, 1024])
def test_every_prompt_of_a_round_is_answered_once(pass_tokens):
    engine, _, counters = _engine(pass_tokens, tiny_model())
    try:
        results = _run_round(engine, PROMPTS)
        assert sorted(results) == sorted(PROMPTS)
        assert counters.get("local_prefill_passes") == (3 if pass_tokens == 0 else 1)
    finally:
        engine.stop()
