"""A KV write that fails on decode fails its request closed: no token, pages freed, and the
engine keeps serving others correctly."""

from __future__ import annotations

from dataclasses import dataclass

from common.kvpool.kv_cache import PoolConfig
from decode_svc.sequence import FailedEvent, FinishedEvent
from tests.isolation.inproc import Harness


@dataclass
class FailingUnpack:
    """Delegates to the real ops; unpack_kv raises while `failing` is set."""

    inner: object
    failing: bool = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def unpack_kv(self, *args, **kwargs):
        if self.failing:
            raise RuntimeError("simulated copy failure")
        return self.inner.unpack_kv(*args, **kwargs)


def test_failed_kv_write_fails_the_request_without_a_token():
    harness = Harness(PoolConfig(pool_tokens=256, page_size=4, poison_freed=True,
                                 check_owners=True))
    try:
        prompt = [5, 9, 13, 17, 21, 25, 29]
        expected = harness.solo(prompt, max_tokens=6)
        ops = FailingUnpack(harness.model.ops)
        harness.model.ops = ops
        ops.failing = True
        harness.submit("broken", prompt, max_tokens=6)
        broken = harness.wait("broken")
        ops.failing = False
        assert broken.tokens == []
        assert isinstance(broken.end, FailedEvent)
        assert broken.end.error.reason == "KV_WRITE_FAILED"
        assert [e["request_id"] for e in harness.log.events("kv_write_failed")][:1] == ["broken"]
        free, total = harness.pages_free()
        assert free == total
        harness.submit("after", prompt, max_tokens=6)
        after = harness.wait("after")
        assert isinstance(after.end, FinishedEvent)
        assert after.tokens == expected
    finally:
        harness.close()
