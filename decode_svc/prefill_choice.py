"""Which prefill replica serves a handoff: one chooser interface, two policies.

Decode keeps one channel per prefill replica (decode_svc.prefill_replicas); for each handoff
attempt it asks a `PrefillChooser` for one replica among the candidates it passes: the replicas
that are healthy (grpc.health.v1 says SERVING), not ejected by their circuit breaker, and not
yet tried for this request. The chooser sees names and loads, never a channel; the receivers
never see the chooser.

Invariants every chooser keeps:
- it returns one of the candidates it was given, or None only when given none;
- it is a pure function of (route key, candidates, its own counter): no I/O, no clock;
- an unscoped request (route key None) goes by load alone.

`PrefixAwareChooser` (the default): the favourite of a scoped request is the candidate with the
highest rendezvous score sha256(route key, replica name), so one scope's prompts that share a
first page meet the same replica's prefix cache, a replica that leaves moves only its own
share of scopes, and every decode process agrees on the favourite without talking to the
others. The favourite is *busy* when it has at least `busy_slack` more handoffs in flight (as
counted by this decode) than the least loaded candidate; then the least loaded candidate
serves, ties broken by rendezvous rank, so a scope's overflow goes to one second replica too.
The default slack of 4 is about one prefill batch of short prompts: waiting behind that costs
less than recomputing a shared prefix elsewhere, and a replica drowning in one hot scope sheds
the excess.

`RoundRobinChooser`: the previous behaviour (gRPC round_robin over the replicas), kept as the
baseline of bench/prefill_choice.py and for operators who want it (--prefill-choice).
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

DOMAIN = b"kvhandoff.prefill-choice.v1"
DEFAULT_BUSY_SLACK = 4


@dataclass(frozen=True)
class Candidate:
    """A replica a handoff may go to: its name (host:port) and handoffs in flight to it."""

    name: str
    in_flight: int


def route_key(cache_scope: bytes, token_ids: Sequence[int], page_size: int) -> bytes | None:
    """The key a request is placed by: its cache scope and its first page's token ids; None
    when the scope is empty (prefill shares such a prompt with nobody) or the prompt is shorter
    than a page (the prefix cache keeps whole pages only): nothing to gain, so load decides."""
    if not cache_scope or page_size <= 0 or len(token_ids) < page_size:
        return None
    h = hashlib.sha256(DOMAIN)
    h.update(len(cache_scope).to_bytes(4, "big") + cache_scope)
    for token in token_ids[:page_size]:
        h.update(int(token).to_bytes(4, "big"))
    return h.digest()


def rendezvous_score(key: bytes, name: str) -> int:
    return int.from_bytes(hashlib.sha256(key + name.encode("utf-8")).digest()[:8], "big")


def rendezvous_order(key: bytes, names: Sequence[str]) -> list[str]:
    """names, favourite first (highest score; a tie, which needs a hash collision, by name)."""
    return sorted(names, key=lambda name: (-rendezvous_score(key, name), name))


class PrefillChooser(abc.ABC):
    """Picks one replica for one handoff attempt; see the module's invariants."""

    name: str = ""

    @abc.abstractmethod
    def choose(self, key: bytes | None, candidates: Sequence[Candidate]) -> str | None:
        """The name of the candidate to use, or None when there is none."""


class PrefixAwareChooser(PrefillChooser):
    name = "prefix"

    def __init__(self, busy_slack: int = DEFAULT_BUSY_SLACK) -> None:
        if busy_slack < 1:
            raise ValueError(f"busy_slack must be at least 1, got {busy_slack}")
        self.busy_slack = busy_slack
        self._turn = 0

    def choose(self, key: bytes | None, candidates: Sequence[Candidate]) -> str | None:
        if not candidates:
            return None
        if key is None:
            return self._least_loaded(candidates)
        load = {c.name: c.in_flight for c in candidates}
        order = rendezvous_order(key, list(load))
        least = min(load.values())
        if load[order[0]] - least < self.busy_slack:
            return order[0]
        return min(order, key=lambda name: load[name])  # min keeps the first of equals

    def _least_loaded(self, candidates: Sequence[Candidate]) -> str:
        """The least loaded; among equals, the next in turn, so idle replicas share the work."""
        least = min(c.in_flight for c in candidates)
        tied = sorted(c.name for c in candidates if c.in_flight == least)
        self._turn += 1
        return tied[self._turn % len(tied)]


class RoundRobinChooser(PrefillChooser):
    name = "round-robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, key: bytes | None, candidates: Sequence[Candidate]) -> str | None:
        if not candidates:
            return None
        names = sorted(c.name for c in candidates)
        self._turn += 1
        return names[self._turn % len(names)]


CHOOSERS = {PrefixAwareChooser.name: PrefixAwareChooser, RoundRobinChooser.name: RoundRobinChooser}


def make_chooser(name: str, busy_slack: int = DEFAULT_BUSY_SLACK) -> PrefillChooser:
    if name == PrefixAwareChooser.name:
        return PrefixAwareChooser(busy_slack)
    if name == RoundRobinChooser.name:
        return RoundRobinChooser()
    raise ValueError(f"unknown prefill choice {name!r} (choose {' or '.join(CHOOSERS)})")
