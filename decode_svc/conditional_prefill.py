"""Conditional disaggregation: decode prefills a short prompt itself while it has nothing else
to do, and hands every other prompt to prefill.

At low load a short prompt's handoff costs more than its prefill: the call, the frames, the
landing and decode's content checks (which recompute a decode step's worth of the prompt) add
to a pass that decode's idle core could run in the same time. So a prompt of at most
`max_tokens` tokens that arrives while the engine is idle (`DecodeEngine.is_idle`: nothing
running, waiting, being checked or joining, and no handoff this receiver sent to prefill still
landing) is computed in place by the engine, exactly as `--local-prefill` does; any other
prompt, and any prompt at all while decode is busy, goes to prefill through the remote receiver
chain (retries, planes, content checks) unchanged. Serving systems call this conditional (or
selective) disaggregation. Of prompts that arrive together at an idle decode (a burst), decode
keeps those whose tokens fit its share (`max_kept_tokens`) and computes the ones queued together
in one pass (LocalPrefillEngine); the rest go to prefill, which computes them meanwhile.

Under load the queue-depth rule (`queue_depth`) shares the prompts between the two cores: when
at least `queue_depth` of this receiver's prompts are with prefill (sent, their KV not all
landed), the next prompt of any length decode can prefill itself is computed here instead, in
chunks of `chunk_tokens` between decode's steps, one such prompt at a time. Without it a burst
of long prompts queues on prefill's core while decode's core, stepping a batch that is waiting
for those prompts, is mostly idle.

Invariants: the choice is made once per request, before any KV moves, from decode's own state
only (nothing prefill says can make decode compute or skip anything); a local prefill's KV is
decode's own (`LandedKv.own_kv`), so there is nothing to check; a remote one is checked as
every handoff is. With max_tokens 0 every prompt goes to prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.counters import Counters
from common.handoff.transfer import TransferRecord
from decode_svc.kv_receiver import HandoffJob, KvReceiver, LandedKv
from decode_svc.local_prefill import LocalPrefillEngine, LocalPrefillReceiver


@dataclass(frozen=True)
class ConditionalPrefillConfig:
    max_tokens: int = 0  # prompts of at most this many tokens may prefill in decode (0: none)
    # the prompt tokens decode may be prefilling itself at once (0: one prompt at a time)
    max_kept_tokens: int = 0
    # this many prompts with prefill: decode computes the next one itself, in chunks (0: never)
    queue_depth: int = 0
    chunk_tokens: int = 256  # the queue-depth rule's chunks
    longest_tokens: int = 0  # the longest prompt decode can prefill itself

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0 or self.queue_depth > 0


class ConditionalReceiver(KvReceiver):
    """remote for every request except a short one that finds the engine idle: local."""

    def __init__(self, config: ConditionalPrefillConfig, engine: LocalPrefillEngine,
                 remote: KvReceiver, counters: Counters) -> None:
        self.config = config
        self.engine = engine
        self.local = LocalPrefillReceiver(engine)
        self.local_chunked = LocalPrefillReceiver(engine, config.chunk_tokens)
        self._taken: dict[str, int] = {}  # kept by the queue-depth rule, prefilling here now
        self.remote = remote
        self.counters = counters
        self._kept: dict[str, int] = {}  # request id -> prompt tokens, prefilling here now
        self._landing: set[str] = set()  # handed to prefill, its KV not all landed yet

    @property
    def plane(self) -> str:
        """The remote chain's plane, read per request (it is negotiated after start-up)."""
        return self.remote.plane

    def keeps_local(self, job: HandoffJob) -> bool:
        """The idle rule: a short prompt, at an idle engine, within the burst's share."""
        request = job.request
        tokens = len(request.token_ids)
        if tokens > self.config.max_tokens:
            return False
        if self._kept and sum(self._kept.values()) + tokens > self.config.max_kept_tokens:
            return False
        return self.engine.is_idle(self._landing)

    def takes_from_queue(self, job: HandoffJob) -> bool:
        """The queue-depth rule: queue_depth prompts already with prefill, none taken here."""
        return (self.config.queue_depth > 0 and not self._taken
                and len(self._landing) >= self.config.queue_depth
                and len(job.request.token_ids) <= self.config.longest_tokens)

    async def receive(self, job: HandoffJob, record: TransferRecord) -> LandedKv:
        request_id = job.request.request_id
        if self.keeps_local(job):
            kept, local = self._kept, self.local
        elif self.takes_from_queue(job):
            kept, local = self._taken, self.local_chunked
            self.counters.add("prefills_taken_from_queue")
        else:
            self._landing.add(request_id)
            try:
                return await self.remote.receive(job, record)
            finally:
                self._landing.discard(request_id)
        record.plane = local.plane
        self.counters.add("prefills_kept_local")
        kept[request_id] = len(job.request.token_ids)
        try:
            return await local.receive(job, record)
        finally:
            kept.pop(request_id, None)

    async def close(self) -> None:
        await self.remote.close()
