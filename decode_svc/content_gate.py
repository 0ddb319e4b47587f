"""Decode's content checks as a stage of the hand-off: the KV that landed is recomputed and
compared (SPEC.md D-45..D-48) before the sequence may join the batch.

`ContentGate.check` runs the checks on one landed handoff. The lifecycle hands it to the
receiver in the HandoffJob (`check`), so the retry (decode_svc/handoff_retry.py) runs it inside
each attempt: a content refusal is an outcome of the attempt on the replica that sent the KV,
counts toward that replica's breaker and is asked again of another replica, before any token is
streamed. The lifecycle calls it again after the receiver returns, which is a no-op on a checked
landing and the check itself behind a receiver that does not retry.

Invariants:
- a `LandedKv` with `content_checked` True passed the checks (or decode runs without them,
  --no-content-checks), and its `first_token` is decode's own (D-48) when they ran;
- the checks never run twice on one landing, and never on KV decode computed itself (own_kv);
- a refusal is a HandoffRefused (KV_NOT_FINITE, KV_LAYER0_MISMATCH, KV_DEPTH_MISMATCH); a check
  that cannot run is decode's own failure (ServiceError CONTENT_CHECK_FAILED), not the peer's.
"""

from __future__ import annotations

import dataclasses

from decode_svc.content_check import ContentVerdict
from decode_svc.content_pipeline import ContentPipeline
from decode_svc.engine import DecodeEngine
from decode_svc.engine_answer import engine_answer
from decode_svc.handoff import HandoffPolicy
from decode_svc.kv_receiver import HandoffJob, LandedKv


class ContentGate:
    def __init__(self, engine: DecodeEngine, policy: HandoffPolicy) -> None:
        self.engine = engine
        self.policy = policy

    async def check(self, landed: LandedKv, job: HandoffJob, log,
                    prepared: ContentPipeline | None = None) -> LandedKv:
        """landed, checked: content_checked set and first_token decode's own (raises
        HandoffRefused otherwise). Prefill's first_token_id is only compared. prepared: the
        attempt's checks run as its KV landed (the engine judges them, or checks in full)."""
        if landed.own_kv or landed.content_checked:
            return landed
        counters = self.engine.counters
        if not landed.bound:
            counters.add("handoffs_protocol_1_0")
        if not self.policy.content.enabled:
            return dataclasses.replace(landed, content_checked=True)
        request_id, token_ids = job.request.request_id, list(job.request.token_ids)
        verdict: ContentVerdict = await engine_answer(
            lambda done: self.engine.verify(request_id, token_ids, job.sampling, done,
                                            prepared))
        log.info("handoff_content_verified", prompt_tokens=len(token_ids),
                 layer0_error=round(verdict.layer0_error, 8),
                 depth_error=round(verdict.depth_error, 8), positions=list(verdict.positions),
                 seconds=round(verdict.seconds, 5),
                 landed_seconds=round(verdict.landed_seconds, 5))
        if verdict.first_token_id != landed.advisory_first_token:
            counters.add("first_token_disagreements")
            log.warning("first_token_disagrees", prefill_first_token=landed.advisory_first_token,
                        decode_first_token=verdict.first_token_id,
                        message="prefill's first_token_id differs from decode's own; decode's "
                                "is streamed")
        return dataclasses.replace(landed, first_token=verdict.first_token_id,
                                   content_checked=True)
