"""`--local-prefill`: decode computes each prompt's KV itself, in one process, with no handoff.

This is the baseline the disaggregated pair is measured against (same model code, same pool,
same sampling), so that TTFT(disaggregated) - TTFT(local) is the transfer time left exposed.
The prompt's prefill runs on the decode engine thread, as one more engine command, straight into
the pages the request reserved; then the request joins the batch exactly as after a verified
handoff (`DecodeEngine.begin`). No prefill service is needed: the limits come from decode's own
capacity instead of the handshake.

A prompt queued with `chunk_tokens` (conditional disaggregation's queue-depth rule: decode
takes a long prompt while it is generating for others) is computed in chunks instead, one chunk
of one such prompt per round of the engine's commands, between two decode steps, so the batch
keeps generating while the prompt fills its pages (vLLM's chunked prefill, on decode's core).

Invariants: as DecodeEngine's. A local prefill writes only the reserved pages of its request,
runs only while the request still holds them (checked before every chunk), and always answers
its `done` callback (the first token, or a ServiceError), so no caller waits forever. A chunk
reads only the pages of its own request: tokens [0, start) its earlier chunks wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from common.config import DecodeConfig
from common.errors import ServiceError
from common.handoff.transfer import TransferRecord, TransferState
from common.model.llama import PrefillBatch
from common.sampling import SamplingConfig, sample_batch
from common.server.grpc_server import set_serving
from common.server.runtime import Runtime
from decode_svc.engine import DecodeEngine
from decode_svc.engine_answer import engine_answer
from decode_svc.state import DecodeState
from decode_svc.engine_commands import LocalPrefill
from decode_svc.kv_receiver import HandoffJob, KvReceiver, LandedKv
from decode_svc.validation import DecodeLimits
from prefill_svc.pass_plan import ChunkSlice, next_slice


@dataclass
class ChunkedPrefill:
    """A LocalPrefill computed chunk by chunk: its pages hold tokens [0, computed_tokens)."""

    command: LocalPrefill
    computed_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.command.token_ids


class LocalPrefillEngine(DecodeEngine):
    """A DecodeEngine that also runs prefill, between decode steps, on its own thread.

    The prompts whose LocalPrefill commands arrived in one round of the engine's commands are
    computed together, in passes of at most `pass_tokens` prompt tokens (whole prompts, in the
    order they were queued: a ragged batch, each prompt attending only to itself), as vLLM's
    scheduler packs waiting prefills; with pass_tokens 0 each prompt has a pass of its own.
    A prompt is computed only if its request still holds its reservation when its pass runs."""

    def __init__(self, *args, pass_tokens: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pass_tokens = pass_tokens  # the pass decode's activation budget was measured at
        self._prefills: list[LocalPrefill] = []  # queued this round, computed after it
        self._chunked: list[ChunkedPrefill] = []  # in chunks, first come first computed
        self._handlers[LocalPrefill] = self._on_local_prefill

    def prefill(self, request_id: str, token_ids: list[int], sampling: SamplingConfig,
                done: Callable[[int | ServiceError], None], chunk_tokens: int = 0) -> None:
        """Computes the prompt's KV into request_id's reserved pages; done(first token id) or
        done(ServiceError). chunk_tokens > 0: in chunks of at most that many tokens, between
        decode steps. Thread-safe; runs after every command queued before it."""
        self.submit(LocalPrefill(request_id, token_ids, sampling, done, chunk_tokens))

    def is_idle(self, landing) -> bool:
        """As DecodeEngine's, and no prompt is being prefilled here in chunks."""
        return not self._chunked and super().is_idle(landing)

    def _has_pending_work(self) -> bool:
        return bool(self._chunked)

    def _on_local_prefill(self, command: LocalPrefill) -> None:
        if 0 < command.chunk_tokens < len(command.token_ids):
            self._chunked.append(ChunkedPrefill(command))
        else:
            self._prefills.append(command)

    def _still_held(self, command: LocalPrefill) -> bool:
        """Whether command's request holds its pages; if not, command is answered CANCELLED."""
        if self.pool.allocator.holds(command.request_id):
            return True
        self._answer(command, ServiceError(grpc.StatusCode.CANCELLED, "REQUEST_RELEASED",
                                           "the request was released before its prefill ran"))
        return False

    def _after_commands(self) -> None:
        queued, self._prefills = self._prefills, []
        held = [command for command in queued if self._still_held(command)]
        self._chunked = [c for c in self._chunked if self._still_held(c.command)]
        if not held and not self._chunked:
            return
        # decode computes: prefill must not borrow these CPUs for a pass meanwhile; and
        # decode may borrow prefill's unless a handoff from prefill is awaited (the prompts
        # computed here reserved pages too, but nobody sends their KV)
        here = {c.request_id for c in held} | {c.command.request_id for c in self._chunked}
        self._cores.decode_state(computing=True, awaiting=bool(self._awaiting_kv - here),
                                 own_pass=True)
        for group in packed_passes(held, self.pass_tokens):
            self._prefill_pass([ChunkSlice(ChunkedPrefill(c), 0, len(c.token_ids))
                                for c in group])
        if self._chunked:  # one chunk of the oldest chunked prompt per round
            job = self._chunked[0]
            piece = next_slice(job, job.command.chunk_tokens, job.command.chunk_tokens)
            if self._prefill_pass([piece]) or piece.is_last:
                self._chunked.pop(0)

    def _prefill_pass(self, pieces: list[ChunkSlice]) -> bool:
        """Computes pieces in one pass; answers each piece's command if its prompt is done or
        the pass failed. True if it failed."""
        commands = [piece.job.command for piece in pieces]
        try:
            firsts = self._forward(pieces)
        except Exception as exc:  # answer the callers; the engine keeps serving
            self.log.exception("local_prefill_failed", error=str(exc),
                               request_ids=[c.request_id for c in commands])
            for command in commands:
                self._answer(command, ServiceError(grpc.StatusCode.INTERNAL,
                                                   "LOCAL_PREFILL_FAILED",
                                                   f"the prefill failed: {exc}"))
            return True
        self.counters.add("local_prefill_passes")
        for piece, first in zip(pieces, firsts, strict=True):
            piece.job.computed_tokens = piece.end
            if piece.is_last:
                self.counters.add("local_prefills")
                self._answer(piece.job.command, first)
        return False

    def _answer(self, command: LocalPrefill, result: int | ServiceError) -> None:
        """command.done(result); a callback that raises never keeps the others unanswered."""
        try:
            command.done(result)
        except Exception as exc:
            self.log.exception("local_prefill_answer_failed", request_id=command.request_id,
                               error=str(exc))

    def _forward(self, pieces: list[ChunkSlice]) -> list[int]:
        """One pass over pieces (each a prompt's tokens [start, end), its pages holding
        [0, start)); returns each piece's next token (the prompt's first generated one when
        the piece is its last)."""
        device = self.model.device
        ids, positions, slots, cu, contexts, tables = [], [], [], [0], [], []
        for piece in pieces:
            command = piece.job.command
            pages = self.pool.allocator.page_table(command.request_id)
            ids += command.token_ids[piece.start:piece.end]
            positions += range(piece.start, piece.end)
            slots += self.pool.slots_for(pages, piece.start, piece.end)
            cu.append(cu[-1] + piece.num_tokens)
            contexts.append(piece.start)
            tables.append(pages)
        paged = any(contexts)  # else every piece starts its prompt: plain causal attention
        width = max(len(t) for t in tables)
        batch = PrefillBatch(
            token_ids=torch.tensor(ids, dtype=torch.int64, device=device),  # [T]
            positions=torch.tensor(positions, dtype=torch.int64, device=device),  # [T]
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),  # [T]
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),  # [B + 1]
            max_seqlen=max(piece.num_tokens for piece in pieces),
            context_lens=(torch.tensor(contexts, dtype=torch.int32, device=device)  # [B]
                          if paged else None),
            page_table=(torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                     dtype=torch.int32, device=device)  # [B, W]
                        if paged else None))
        logits = self.model.prefill(batch, self.pool.k, self.pool.v)  # [B, vocab]
        return sample_batch(logits, [piece.job.command.sampling for piece in pieces],
                            [0] * len(pieces))


def packed_passes(queued: list[LocalPrefill], pass_tokens: int) -> list[list[LocalPrefill]]:
    """queued, in order, cut into passes of at most pass_tokens prompt tokens (a longer prompt
    has a pass of its own); pass_tokens 0: one prompt a pass."""
    passes: list[list[LocalPrefill]] = []
    tokens = 0
    for command in queued:
        n = len(command.token_ids)
        if passes and pass_tokens and tokens + n <= pass_tokens:
            passes[-1].append(command)
            tokens += n
        else:
            passes.append([command])
            tokens = n
    return passes


async def prefill_locally(engine: LocalPrefillEngine, request_id: str, token_ids: list[int],
                          sampling: SamplingConfig, chunk_tokens: int = 0) -> int:
    """Awaits the local prefill of a request that holds its reservation; returns the first
    token or raises the engine's ServiceError."""
    return await engine_answer(
        lambda done: engine.prefill(request_id, token_ids, sampling, done, chunk_tokens))


class LocalPrefillReceiver(KvReceiver):
    """The `--local-prefill` plane: the KV never travels; the engine computes it in place."""

    plane = "local"

    def __init__(self, engine: LocalPrefillEngine, chunk_tokens: int = 0) -> None:
        self.engine = engine
        self.chunk_tokens = chunk_tokens  # > 0: prompts longer than this go in chunks

    async def receive(self, job: HandoffJob, record: TransferRecord) -> LandedKv:
        record.move(TransferState.TRANSFERRING)
        try:
            first = await prefill_locally(self.engine, job.request.request_id,
                                          list(job.request.token_ids), job.sampling,
                                          self.chunk_tokens)
        except BaseException as err:
            record.move(TransferState.FAILED, getattr(err, "reason", type(err).__name__))
            raise
        record.move(TransferState.SUCCESS)
        return LandedKv(first, 0, bound=True, own_kv=True)


def local_limits(config: DecodeConfig, runtime: Runtime) -> DecodeLimits:
    """Decode's limits when it is its own prefill: its window and its pool bound everything."""
    capacity = runtime.capacity
    return DecodeLimits(
        vocab_size=runtime.loaded.config.vocab_size, context_window=capacity.context_window,
        own_pool_tokens=capacity.pool_tokens, prefill_max_prompt=capacity.max_prompt_tokens,
        default_max_tokens=config.default_max_tokens)


async def agree_locally(config: DecodeConfig, runtime: Runtime, state: DecodeState, health,
                        service_names: list[str], log) -> None:
    """Stands in for the handshake with prefill: sets the limits and reports SERVING."""
    state.limits = local_limits(config, runtime)
    log.info("local_prefill", message="prefill runs inside decode; no handoff",
             max_prompt=state.limits.prefill_max_prompt,
             context_window=state.limits.context_window)
    await set_serving(health, service_names, True)
