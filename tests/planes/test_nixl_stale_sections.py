"""decode's NixlReceiver drops a peer's loaded sections before loading buffer metadata the
peer never sent before, when no handoff uses the peer: NIXL keeps the first remote descriptor
of a memory range and ignores a later identical one, so a range prefill deregistered and
registered again (P-68's pages, a packed buffer freed and reallocated) would still be named by
its old registration (an invalid RDMA rkey). Metadata sent before (a packed buffer reused)
loads as always; a peer in use by another handoff is never dropped."""

from __future__ import annotations

from decode_svc.nixl_receiver import NixlReceiver


class FakeAgent:
    """The agent calls load_peer makes: every metadata blob names the peer 'prefill'."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []

    def add_remote(self, metadata: bytes) -> str:
        self.calls.append(("add", metadata))
        return "prefill"

    def remove_remote(self, name: str) -> None:
        self.calls.append(("remove", b""))


def _receiver() -> tuple[NixlReceiver, FakeAgent]:
    receiver = NixlReceiver.__new__(NixlReceiver)  # only the peer bookkeeping is exercised
    agent = FakeAgent()
    receiver.agent = agent
    receiver._sections, receiver._users, receiver._blobs = {}, {}, {}
    return receiver, agent


def _handoff(receiver: NixlReceiver, metadata: bytes) -> None:
    peer = receiver.load_peer(metadata)
    receiver.use_peer(peer)
    receiver.unload_peer(peer)


def test_new_metadata_of_an_idle_peer_drops_its_sections_first():
    receiver, agent = _receiver()
    _handoff(receiver, b"A")
    _handoff(receiver, b"A")  # the same registration again: loaded as always
    assert agent.calls == [("add", b"A"), ("add", b"A")]
    _handoff(receiver, b"B")  # a registration the peer never sent: stale sections go first
    assert agent.calls[2:] == [("add", b"B"), ("remove", b""), ("add", b"B")]
    assert receiver._sections == {"prefill": 1} and receiver._blobs == {"prefill": {b"B"}}


def test_a_peer_another_handoff_uses_is_not_dropped():
    receiver, agent = _receiver()
    peer = receiver.load_peer(b"A")
    receiver.use_peer(peer)  # a handoff in flight reads from it
    _handoff(receiver, b"B")
    assert ("remove", b"") not in agent.calls
    receiver.unload_peer(peer)
    assert receiver._users == {"prefill": 0} and receiver._sections == {"prefill": 2}
