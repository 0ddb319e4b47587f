"""Retry before the first token: a handoff that failed on one prefill replica is asked again on
another, with a fresh nonce and a fresh request, while no token has reached the client.

`RetryingReceiver` wraps the receiver decode holds (the plane-negotiating one) and runs inside
the lifecycle's hand-off stage, which comes before any token is streamed; so by construction a
retry never follows a token. Which failures it retries:
- transport (reason label `transport`): PEER_UNAVAILABLE (UNAVAILABLE, a peer that died or
  reset the stream), TRANSFER_FAILED and TRANSFER_TIMEOUT (an out-of-band plane failed);
- refused (label `refused`): any other refusal of the handoff's form, of its content (the
  job's `check`, run inside each attempt: KV_LAYER0_MISMATCH, KV_DEPTH_MISMATCH) or of the peer
  (a bad frame, a checksum, PEER_REJECTED ...): never on the same replica, once more on another;
  KV_NOT_FINITE is a content refusal like those (each attempt starts with decode's record of
  the request's writes forgotten, `new_attempt`, so one replica's NaN never counts against the
  next);
- never: HANDOFF_TIMEOUT (the budget is spent); and anything that is not a HandoffRefused
  (decode's own failures, such as CONTENT_CHECK_FAILED, and a client that left).
Every refusal, retried or not, counts against the replica that sent the handoff.
At most `max_retries` retries per request, each on a replica the request has not tried, within
what is left of the first attempt's budget. Every attempt's outcome goes to the replica's
breaker (prefill_replicas.report), so a replica that keeps failing is ejected.

Pages: the retry reuses the request's reservation. The failed attempt's receiver has returned
(no peer call, mapping or READ open, per KvReceiver), and `new_attempt` (awaited before the
retry asks anything) returns only after the engine ran every write the failed attempt queued
and forgot what they recorded (finiteness, a failed write); so nothing of the failed attempt
writes those pages any more, and the retry's verifier demands every token of every layer again
before the pages are read; the lifecycle releases them once, however the request ends.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable

from common.counters import Counters
from common.handoff.binding import new_nonce
from common.handoff.reasons import HandoffRefused
from common.handoff.transfer import TransferRecord
from common.pb.kvhandoff.v1 import handoff_pb2
from decode_svc.kv_receiver import HandoffJob, KvReceiver, LandedKv
from decode_svc.prefill_replicas import PrefillReplicas

DEFAULT_MAX_RETRIES = 2
TRANSPORT_REASONS = frozenset({"PEER_UNAVAILABLE", "TRANSFER_FAILED", "TRANSFER_TIMEOUT"})
NEVER_RETRIED = frozenset({"HANDOFF_TIMEOUT"})
MIN_RETRY_BUDGET_S = 0.5


def retry_class(err: HandoffRefused) -> str | None:
    """'transport', 'refused', or None (not retried)."""
    if err.reason in NEVER_RETRIED:
        return None
    return "transport" if err.reason in TRANSPORT_REASONS else "refused"


def fresh_job(job: HandoffJob, timeout_s: float) -> HandoffJob:
    """The same prompt asked again: a new PrefillRequest with a new nonce, expected as such."""
    nonce = new_nonce()
    request = handoff_pb2.PrefillRequest()
    request.CopyFrom(job.request)
    request.nonce = nonce
    return HandoffJob(request, dataclasses.replace(job.expect, nonce=nonce), job.sampling,
                      timeout_s, job.check)


class RetryingReceiver(KvReceiver):
    def __init__(self, inner: KvReceiver, replicas: PrefillReplicas, counters: Counters,
                 retried: Callable[[str], None], log, max_retries: int = DEFAULT_MAX_RETRIES,
                 clock: Callable[[], float] = time.monotonic,
                 new_attempt: Callable[[str], Awaitable[None]] | None = None) -> None:
        self.inner = inner
        self.replicas = replicas
        self.counters = counters
        self.retried = retried  # metrics: kvhandoff_handoff_retried_total{reason}
        self.log = log
        self.max_retries = max_retries
        self.clock = clock
        # awaited before each retry: the engine has run the failed attempt's writes and forgot
        # what they recorded (DecodeEngine.new_attempt)
        self.new_attempt = new_attempt

    @property
    def plane(self) -> str:  # type: ignore[override]
        return self.inner.plane

    async def receive(self, job: HandoffJob, record: TransferRecord) -> LandedKv:
        request_id = job.request.request_id
        deadline = self.clock() + job.timeout_s
        retries = 0
        try:
            while True:
                try:
                    landed = await self.inner.receive(job, record)
                    if job.check is not None:  # the content checks judge this attempt too
                        landed = await job.check(landed, job)
                except HandoffRefused as err:
                    self.replicas.report(request_id, err.reason)
                    why = retry_class(err)
                    left = deadline - self.clock()
                    if (why is None or retries >= self.max_retries or left < MIN_RETRY_BUDGET_S
                            or not self.replicas.has_untried(request_id)):
                        raise
                    retries += 1
                    self._count(why, err, request_id)
                    if self.new_attempt is not None:
                        await self.new_attempt(request_id)
                    job, record = fresh_job(job, left), TransferRecord(request_id, self.plane)
                    continue
                except BaseException:
                    self.replicas.report(request_id, None, judged=False)
                    raise
                self.replicas.report(request_id, None)
                return landed
        finally:
            self.replicas.forget(request_id)

    def _count(self, why: str, err: HandoffRefused, request_id: str) -> None:
        self.counters.add(f"handoff_retried_{why}")
        self.retried(why)
        self.log.warning("handoff_retried", request_id=request_id, reason=why,
                         refusal=err.reason, replica=self.replicas.last_tried(request_id),
                         message=err.message)

    async def close(self) -> None:
        await self.inner.close()
