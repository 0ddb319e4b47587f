"""The seam on decode: how a request's KV reaches its reserved pages.

One `KvReceiver` per decode process, chosen at start (inline gRPC bytes, shared memory, local
prefill, or a test fake); the servicer calls `receive` and never asks which one it holds.

Invariants every receiver keeps:
- it is called only after the request's pages were reserved, and writes only those pages, only
  through `DecodeEngine.write` (so the engine's queue order still puts every write before the
  request's `verify`, `begin` and `release`);
- bytes that came from a peer are verified (the 1.1 frame rules and checksums) over decode's own
  copy, never over memory the peer can still change, before they are written;
- it returns only when every write of the handoff is queued, and raises HandoffRefused (or
  ServiceError) otherwise; it never leaves a peer call or a mapped region open when it returns;
- it moves the `TransferRecord` it was given to SUCCESS or FAILED before it returns.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from common.handoff.transfer import TransferRecord
from common.handoff.verifier import Expectation
from common.pb.kvhandoff.v1 import handoff_pb2
from common.sampling import SamplingConfig


@dataclass(frozen=True)
class HandoffJob:
    """What decode asks for one request (its pages already reserved)."""

    request: handoff_pb2.PrefillRequest  # as sent to prefill; its data_plane set by the receiver
    expect: Expectation
    sampling: SamplingConfig
    timeout_s: float
    # decode's content checks (decode_svc/content_gate.py): a receiver that retries on another
    # replica runs them inside each attempt, so that a content refusal is the attempt's outcome
    check: Callable[[LandedKv, HandoffJob], Awaitable[LandedKv]] | None = None


@dataclass(frozen=True)
class LandedKv:
    """A handoff whose KV is verified in form and whose writes are queued on the engine.

    own_kv: decode computed the KV itself (local prefill): first_token is decode's own and the
    content checks have nothing to check. Otherwise first_token is prefill's advisory
    first_token_id, and the servicer runs the content checks before any token is streamed."""

    first_token: int
    payload_bytes: int
    bound: bool  # protocol 1.1 binding checked (False: a 1.0 prefill the operator allowed)
    own_kv: bool = False
    # prompt tokens prefill served from its prefix cache (a verified 1.2 commit's count, D-90)
    cached_tokens: int = 0
    # the content checks already ran on this KV and passed: first_token is decode's own
    content_checked: bool = False

    @property
    def advisory_first_token(self) -> int:
        return self.first_token


class KvReceiver(abc.ABC):
    """Lands one request's KV in its reserved pages; see the module's invariants."""

    plane: str = ""  # the data plane's name as the SPEC and the logs say it

    @abc.abstractmethod
    async def receive(self, job: HandoffJob, record: TransferRecord) -> LandedKv:
        """Returns once the KV is landed (and record is SUCCESS); raises otherwise (FAILED)."""

    async def close(self) -> None:  # noqa: B027 - optional hook; most receivers hold nothing
        """Releases what the receiver holds across requests (channels, mappings)."""
