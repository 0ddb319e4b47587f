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

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0


class ConditionalReceiver(KvReceiver):
    """remote for every request except a short one that finds the engine idle: local."""

    def __init__(self, config: ConditionalPrefillConfig, engine: LocalPrefillEngine,
                 remote: KvReceiver, counters: Counters) -> None:
        self.config = config
        self.engine = engine
        self.local = LocalPrefillReceiver(engine)
        self.remote = remote
        self.counters = counters
        self._kept: dict[str, int] = {}  # request id -> prompt tokens, prefilling here now
        self._landing: set[str] = set()  # handed to prefill, its KV not all landed yet

    @property
    def plane(self) -> str:
        """The remote chain's plane, read per request (it is negotiated after start-up)."""
        return self.remote.plane

    def keeps_local(self, job: HandoffJob) -> bool:
        request = job.request
        tokens = len(request.token_ids)
        if tokens > self.config.max_tokens:
            return False
        if self._kept and sum(self._kept.values()) + tokens > self.config.max_kept_tokens:
            return False
        return self.engine.is_idle(self._landing)

    async def receive(self, job: HandoffJob, record: TransferRecord) -> LandedKv:
        request_id = job.request.request_id
        if not self.keeps_local(job):
            self._landing.add(request_id)
            try:
                return await self.remote.receive(job, record)
            finally:
                self._landing.discard(request_id)
        record.plane = self.local.plane
        self.counters.add("prefills_kept_local")
        self._kept[request_id] = len(job.request.token_ids)
        try:
            return await self.local.receive(job, record)
        finally:
            self._kept.pop(request_id, None)

    async def close(self) -> None:
        await self.remote.close()
