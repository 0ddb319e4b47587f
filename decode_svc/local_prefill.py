"""`--local-prefill`: decode computes each prompt's KV itself, in one process, with no handoff.

This is the baseline the disaggregated pair is measured against (same model code, same pool,
same sampling), so that TTFT(disaggregated) - TTFT(local) is the transfer time left exposed.
The prompt's prefill runs on the decode engine thread, as one more engine command, straight into
the pages the request reserved; then the request joins the batch exactly as after a verified
handoff (`DecodeEngine.begin`). No prefill service is needed: the limits come from decode's own
capacity instead of the handshake.

Invariants: as DecodeEngine's. A local prefill writes only the reserved pages of its request,
runs only while the request still holds them, and always answers its `done` callback (the first
token, or a ServiceError), so no caller waits forever.
"""

from __future__ import annotations

from collections.abc import Callable

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


class LocalPrefillEngine(DecodeEngine):
    """A DecodeEngine that also runs prefill, between decode steps, on its own thread."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._handlers[LocalPrefill] = self._on_local_prefill

    def prefill(self, request_id: str, token_ids: list[int], sampling: SamplingConfig,
                done: Callable[[int | ServiceError], None]) -> None:
        """Computes the prompt's KV into request_id's reserved pages; done(first token id) or
        done(ServiceError). Thread-safe; runs after every command queued before it."""
        self.submit(LocalPrefill(request_id, token_ids, sampling, done))

    def _on_local_prefill(self, command: LocalPrefill) -> None:
        request_id, token_ids, sampling, done = (command.request_id, command.token_ids,
                                                 command.sampling, command.done)
        if not self.pool.allocator.holds(request_id):
            done(ServiceError(grpc.StatusCode.CANCELLED, "REQUEST_RELEASED",
                              "the request was released before its prefill ran"))
            return
        # decode computes: prefill must not borrow these CPUs for a pass meanwhile
        self._cores.decode_state(computing=True, awaiting=bool(self._awaiting_kv))
        try:
            done(self._prefill_one(request_id, token_ids, sampling))
        except Exception as exc:  # answer the caller; the engine keeps serving
            self.log.exception("local_prefill_failed", request_id=request_id, error=str(exc))
            done(ServiceError(grpc.StatusCode.INTERNAL, "LOCAL_PREFILL_FAILED",
                              f"the prefill failed: {exc}"))

    def _prefill_one(self, request_id: str, token_ids: list[int], sampling: SamplingConfig
                     ) -> int:
        device = self.model.device
        n = len(token_ids)
        pages = self.pool.allocator.page_table(request_id)
        batch = PrefillBatch(
            token_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
            positions=torch.arange(n, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(self.pool.slots_for(pages, 0, n), dtype=torch.int64,
                                      device=device),
            cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=device), max_seqlen=n)
        logits = self.model.prefill(batch, self.pool.k, self.pool.v)  # [1, vocab]
        self.counters.add("local_prefills")
        return sample_batch(logits, [sampling], [0])[0]


async def prefill_locally(engine: LocalPrefillEngine, request_id: str, token_ids: list[int],
                          sampling: SamplingConfig) -> int:
    """Awaits the local prefill of a request that holds its reservation; returns the first
    token or raises the engine's ServiceError."""
    return await engine_answer(
        lambda done: engine.prefill(request_id, token_ids, sampling, done))


class LocalPrefillReceiver(KvReceiver):
    """The `--local-prefill` plane: the KV never travels; the engine computes it in place."""

    plane = "local"

    def __init__(self, engine: LocalPrefillEngine) -> None:
        self.engine = engine

    async def receive(self, job: HandoffJob, record: TransferRecord) -> LandedKv:
        record.move(TransferState.TRANSFERRING)
        try:
            first = await prefill_locally(self.engine, job.request.request_id,
                                          list(job.request.token_ids), job.sampling)
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
