"""common.handoff.nixl_buffers: buffers come in power-of-two sizes, are reused after give_back
with the same registration, and idle ones over the cap are deregistered at once."""

from __future__ import annotations

from common.handoff.nixl_agent import Registration
from common.handoff.nixl_buffers import MIN_BYTES, RegisteredBuffers, size_class


class FakeAgent:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}

    def register(self, buf, share: bool) -> Registration:
        self.registered[buf.ctypes.data] = buf.nbytes
        return Registration(buf.ctypes.data, buf.nbytes, None, b"meta" if share else b"")

    def deregister(self, reg: Registration) -> None:
        del self.registered[reg.address]


def test_size_classes():
    assert size_class(1) == MIN_BYTES and size_class(MIN_BYTES) == MIN_BYTES
    assert size_class(MIN_BYTES + 1) == 2 * MIN_BYTES and size_class(1 << 30) == 1 << 30


def test_a_buffer_given_back_serves_the_next_handoff_registered():
    agent = FakeAgent()
    buffers = RegisteredBuffers(agent, share=True, max_idle_bytes=64 << 20)
    buf, reg = buffers.acquire(5 << 20)
    assert buf.nbytes == reg.size == 8 << 20 and reg.metadata == b"meta"
    other, _ = buffers.acquire(6 << 20)  # in use by another handoff: a new one
    assert other is not buf and len(agent.registered) == 2
    buffers.give_back(buf, reg)
    again, reg_again = buffers.acquire(7 << 20)
    assert again is buf and reg_again is reg and len(agent.registered) == 2


def test_idle_buffers_over_the_cap_are_deregistered():
    agent = FakeAgent()
    buffers = RegisteredBuffers(agent, share=False, max_idle_bytes=8 << 20)
    held = [buffers.acquire(8 << 20) for _ in range(2)]
    for buf, reg in held:
        buffers.give_back(buf, reg)
    assert buffers.idle_bytes == 8 << 20 and len(agent.registered) == 1
    buffers.close()
    assert agent.registered == {} and buffers.idle_bytes == 0
