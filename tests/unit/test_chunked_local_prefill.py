"""Decode's own prefill in chunks (LocalPrefill.chunk_tokens, the queue-depth rule of
conditional disaggregation): the same first token and the same KV in the same pages as one
pass over the whole prompt, one chunk per round with no command needed to move on, a request
released between chunks answered and its pages back, a failing chunk answered and the engine
still serving; and decode's own passes may borrow prefill's cores unless a handoff is
awaited."""

from __future__ import annotations


import pytest
import torch

from common.counters import Counters
from common.errors import ServiceError
from common.kvpool.kv_cache import PoolConfig
from common.server.core_borrowing import CoreBorrowing, CoreBorrowingConfig
from decode_svc.local_prefill import LocalPrefillEngine
from tests.isolation.inproc import RecordingLog, make_pool, tiny_model
from tests.unit.test_packed_local_prefill import (GREEDY, PROMPTS, _Answers,
                                                  _assert_drained_to, _engine, _kv_of,
                                                  _prefill_alone)

LONG = "c"  # 37 tokens over three 16-token pages


def _chunked(engine, name: str, chunk_tokens: int) -> object:
    """Reserves name's pages and prefills its prompt in chunks; returns the answer."""
    reserved = _Answers(1)
    engine.reserve(name, len(PROMPTS[name]), reserved.done_for(name))
    answers = _Answers(1)
    engine.prefill(name, PROMPTS[name], GREEDY, answers.done_for(name), chunk_tokens)
    engine.start()
    reserved.wait()
    return answers.wait()[name]


@pytest.mark.parametrize("chunk_tokens, passes", [(5, 8), (16, 3), (36, 2)])
def test_chunks_give_the_first_token_and_kv_of_one_pass(chunk_tokens, passes):
    model = tiny_model(seed=5)
    alone_first, alone_kv = _prefill_alone(model, LONG)
    engine, pool, counters = _engine(0, model)
    try:
        first = _chunked(engine, LONG, chunk_tokens)
        assert first == alone_first
        assert counters.get("local_prefill_passes") == passes  # ceil(37 / chunk_tokens)
        assert counters.get("local_prefills") == 1
        torch.testing.assert_close(_kv_of(pool, LONG, len(PROMPTS[LONG])), alone_kv,
                                   rtol=1e-5, atol=1e-5)
    finally:
        engine.stop()


def test_a_prompt_no_longer_than_its_chunk_is_one_pass():
    engine, _, counters = _engine(0, tiny_model())
    try:
        assert isinstance(_chunked(engine, "b", 5), int)
        assert counters.get("local_prefill_passes") == 1
    finally:
        engine.stop()


def test_a_request_released_between_chunks_is_answered_and_leaves_nothing(monkeypatch):
    model = tiny_model()
    engine, pool, counters = _engine(0, model)
    baseline = pool.allocator.snapshot().pages_free
    real_prefill, calls = model.prefill, []

    def release_after_the_first_chunk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            engine.release(LONG)  # lands in the next round, before the next chunk
        return real_prefill(*args, **kwargs)

    monkeypatch.setattr(model, "prefill", release_after_the_first_chunk)
    try:
        result = _chunked(engine, LONG, 8)
        assert isinstance(result, ServiceError) and result.reason == "REQUEST_RELEASED"
        assert len(calls) == 1 and counters.get("local_prefills") == 0
        _assert_drained_to(engine, pool, baseline)
    finally:
        engine.stop()


def test_a_failing_chunk_answers_and_the_engine_keeps_serving(monkeypatch):
    model = tiny_model()
    engine, _, counters = _engine(0, model)
    real_prefill, calls = model.prefill, []

    def fail_the_second_chunk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real_prefill(*args, **kwargs)

    monkeypatch.setattr(model, "prefill", fail_the_second_chunk)
    try:
        result = _chunked(engine, LONG, 8)
        assert isinstance(result, ServiceError) and result.reason == "LOCAL_PREFILL_FAILED"
        assert len(calls) == 2  # the prompt is dropped: no third chunk
        reserved, again = _Answers(1), _Answers(1)
        engine.reserve("a", len(PROMPTS["a"]), reserved.done_for("a"))
        engine.prefill("a", PROMPTS["a"], GREEDY, again.done_for("a"), 4)
        reserved.wait()
        assert isinstance(again.wait()["a"], int)
        assert counters.get("local_prefills") == 1
    finally:
        engine.stop()


class _RecordingCores(CoreBorrowing):
    """Records the awaiting flag of every own_pass decode_state call."""

    def __init__(self) -> None:
        super().__init__(CoreBorrowingConfig())
        self.own_passes: list[bool] = []

    def decode_state(self, computing: bool, awaiting: bool, own_pass: bool = False) -> None:
        if own_pass:
            self.own_passes.append(awaiting)


@pytest.mark.parametrize("handoff_awaited", [False, True])
def test_an_own_pass_may_borrow_unless_a_handoff_from_prefill_is_awaited(handoff_awaited):
    model, cores = tiny_model(), _RecordingCores()
    pool = make_pool(model, PoolConfig(pool_tokens=256, page_size=16))
    engine = LocalPrefillEngine(model, pool, 8, 8, RecordingLog(), Counters(), None, cores)
    try:
        reserved = _Answers(2)
        engine.reserve("mine", len(PROMPTS["a"]), reserved.done_for("mine"))
        if handoff_awaited:  # reserved for a handoff prefill computes: its KV is awaited
            engine.reserve("theirs", 8, reserved.done_for("theirs"))
        else:
            reserved.done_for("none")(None)
        answers = _Answers(1)
        engine.prefill("mine", PROMPTS["a"], GREEDY, answers.done_for("mine"), 4)
        engine.start()
        reserved.wait()
        assert isinstance(answers.wait()["mine"], int)
        assert cores.own_passes and set(cores.own_passes) == {handoff_awaited}
    finally:
        engine.stop()
