"""A decode step that raises fails the sequences of that batch with DECODE_STEP_FAILED and frees
their pages; the engine thread survives and serves the next request exactly."""

from __future__ import annotations

import grpc

from common.kvpool.kv_cache import PoolConfig
from decode_svc.sequence import FailedEvent
from tests.isolation.inproc import Harness


def test_a_failing_step_fails_its_batch_and_the_engine_keeps_serving():
    h = Harness(PoolConfig(pool_tokens=128, page_size=4, poison_freed=True, check_owners=True))
    try:
        prompt_a, prompt_b = [5, 6, 7, 8, 9, 10, 11], [12, 13, 14]
        expected = h.solo(prompt_a, 8)
        real_decode = h.model.decode
        calls = {"n": 0}

        def failing_once(batch, k, v):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected step failure")
            return real_decode(batch, k, v)

        h.model.decode = failing_once
        h.submit("doomed", prompt_b, 8)
        outcome = h.wait("doomed")
        assert isinstance(outcome.end, FailedEvent)
        assert outcome.end.error.reason == "DECODE_STEP_FAILED"
        assert outcome.end.error.code == grpc.StatusCode.INTERNAL
        assert outcome.tokens and len(outcome.tokens) == 1  # the first token came from prefill
        assert h.pages_free() == (32, 32)
        assert h.solo(prompt_a, 8) == expected
        assert [r["request_ids"] for r in h.log.events("decode_step_failed")] == [["doomed"]]
    finally:
        h.close()
