"""The decode engine's commands: one frozen dataclass each, dispatched on their type.

They travel on the engine's one inbox and run in the order queued (so a request's writes always
run before its verify, begin and release). An engine accepts only the command types it has a
handler for: `DecodeEngine.submit` refuses anything else at once, in the caller's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from common.sampling import SamplingConfig
from decode_svc.sequence import Sequence


@dataclass(frozen=True)
class Stop:
    """Ends the engine thread after the commands queued before it."""


@dataclass(frozen=True)
class Reserve:
    """done(pages) once reserved, or done(ServiceError) when the admission queue is full."""

    request_id: str
    num_tokens: int
    done: Callable[[object], None]


@dataclass(frozen=True)
class Write:
    """kv: [2, n, Hkv, D] on the CPU, for tokens [token_start, token_start + n) of layer."""

    request_id: str
    layer: int
    token_start: int
    kv: torch.Tensor


@dataclass(frozen=True)
class WriteBytes:
    """A received chunk as it arrived: k and v are uint8 arrays of num_tokens x Hkv x D values
    each, little-endian, decode's own copy (the received frame, or what decode read out of a
    region), for tokens [token_start, token_start + num_tokens) of layer; read only."""

    request_id: str
    layer: int
    token_start: int
    num_tokens: int
    k: np.ndarray
    v: np.ndarray


@dataclass(frozen=True)
class Landed:
    """A verified chunk an out-of-band plane read straight into the request's pages
    (decode_svc.page_landing); pieces: its K and V views there, for the finiteness check (on
    the engine thread, beside the event loop's read of the next chunk)."""

    request_id: str
    pieces: tuple


@dataclass(frozen=True)
class AfterWrites:
    """Runs then() on the engine thread once every command queued before it ran: a plane hands
    back the buffer its queued writes read from (decode_svc.nixl_receiver)."""

    then: Callable[[], None]


@dataclass(frozen=True)
class Verify:
    """The content checks over the request's pages; done(ContentVerdict | ServiceError)."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingConfig
    done: Callable[[object], None]
    # decode_svc.content_pipeline.ContentPipeline: the checks already run as the KV landed
    prepared: object | None = None


@dataclass(frozen=True)
class Begin:
    """The handoff of seq was verified and its writes queued: join the running batch."""

    seq: Sequence


@dataclass(frozen=True)
class NewAttempt:
    """Another handoff attempt is about to write into the request's reservation (a retry on
    another replica): forget what earlier attempts' writes recorded (finiteness, a failed
    write); the pages stay held, and the new attempt's verifier demands every token again.
    done(None) on the engine thread once handled, that is after every write queued before it
    (an earlier attempt's queued writes can no longer land over what a plane that writes the
    pages directly lands for the new one)."""

    request_id: str
    done: Callable[[object], None]


@dataclass(frozen=True)
class Release:
    """Frees whatever the request holds or waits for; safe more than once."""

    request_id: str


@dataclass(frozen=True)
class LocalPrefill:
    """--local-prefill: compute the prompt's KV into the request's reserved pages;
    done(first token id | ServiceError). chunk_tokens > 0: a longer prompt is computed in
    chunks of at most that many tokens, one chunk between two decode steps."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingConfig
    done: Callable[[object], None]
    chunk_tokens: int = 0
