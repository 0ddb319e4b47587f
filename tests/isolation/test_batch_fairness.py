"""More running sequences than max_batch share the steps (round robin)."""

from __future__ import annotations

from common.kvpool.kv_cache import PoolConfig
from decode_svc.sequence import FinishedEvent, TokenEvent
from tests.isolation.inproc import Harness


def test_sequences_beyond_max_batch_take_turns():
    harness = Harness(PoolConfig(pool_tokens=512, page_size=4), max_batch=1)
    order: list[str] = []
    try:
        prompts = {"a": [5, 6, 7, 8], "b": [9, 10, 11]}
        solo = {rid: harness.solo(p, max_tokens=12) for rid, p in prompts.items()}

        def record(rid):
            return lambda seq, event: order.append(rid) if isinstance(event, TokenEvent) else None

        for rid, prompt in prompts.items():
            harness.submit(rid, prompt, max_tokens=12, hook=record(rid))
        outcomes = {rid: harness.wait(rid) for rid in prompts}
        assert all(isinstance(o.end, FinishedEvent) for o in outcomes.values())
        assert {rid: o.tokens for rid, o in outcomes.items()} == solo
        # b's second token comes before a's last: they alternate instead of running a to the end
        assert order.index("b", order.index("b") + 1) < len(order) - 1 - order[::-1].index("a")
    finally:
        harness.close()

