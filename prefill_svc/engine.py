"""The prefill engine thread: owns the model and the pool, runs forward passes over chunks of
prompts (chunked prefill, see pass_plan), and emits each layer's KV as frames as soon as that
layer of a chunk is stored.

A job's prompt is computed over one or more passes of at most ``prefill_chunk_tokens`` of its
tokens each; each chunk's queries attend to the job's pages written so far and causally within
the chunk. Frames go out chunk-major, layer-minor (SPEC section 3 lets chunks come in any order
that covers every (layer, token) once); the commit follows the last chunk, its first token
sampled from the last chunk's logits.

Invariants: a job's pages for its whole prompt are allocated at admission, before its first
pass, and freed after its commit or abort, whatever happens (or, when its sender's frames name
the pages themselves, held by the sender's owner until the sender returns them); a cancelled
job gets no more frames; compute never runs on the event loop (servicers only call `submit`).
Frames leave this thread already serialized (the protobuf encoding of a PrefillResponse, crc32c
included), so the event loop only hands bytes to gRPC.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.config import DEFAULT_PREFILL_CHUNK_TOKENS
from common.counters import Counters
from common.handoff.codec import commit_frame, frame_wire
from common.handoff.layout import KvLayout
from common.kvpool.kv_cache import KvPool
from common.metrics import NullMetrics
from common.model.llama import LlamaModel, PrefillBatch
from common.pb.kvhandoff.v1 import handoff_pb2
from common.sampling import SamplingConfig, sample_batch
from common.server.core_borrowing import CoreBorrowing, CoreBorrowingConfig
from prefill_svc.kv_sender import InlineSender, KvSender
from prefill_svc.pass_plan import ChunkSlice, next_slice, plan_running
from prefill_svc.prefix_cache import PrefixCache, PrefixCacheConfig
from prefill_svc.send_budget import JobBytes, SendBudget


@dataclass
class PrefillJob:
    """emit(frame) is thread-safe; frame is a serialized PrefillResponse; emit(None) ends the
    job's stream. chunk_tokens is the most tokens of one KV frame (from max_chunk_bytes), not
    the prefill chunk.

    Progress: tokens [0, computed_tokens) have their KV in the job's pages, and tokens
    [0, streamed_tokens) have had their frames emitted for every layer. A job may be submitted
    with computed_tokens > 0 (a prefix whose KV its pages already hold, e.g. a prefix-cache
    hit); it must stay below the prompt length (the last token's logits are computed), and
    those tokens' frames go out with the job's first chunk."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingConfig
    chunk_tokens: int
    emit: Callable[[bytes | None], None]
    nonce: bytes = b""  # the request's, echoed in every frame (1.1)
    cancelled: threading.Event = field(default_factory=threading.Event)
    chunks_sent: int = 0
    submitted: float = field(default_factory=time.monotonic)
    unsent: JobBytes = field(default_factory=JobBytes)
    sender: KvSender = field(default_factory=InlineSender)  # the plane the chunks leave by
    computed_tokens: int = 0
    # of computed_tokens, those whose KV the job's pages held when reserved (a prefix-cache
    # hit or the submitter's preset); fixed from then on
    cached_tokens: int = 0
    streamed_tokens: int = 0
    cache_scope: bytes = b""  # who may share its cached prefix (decode's, SPEC.md D-80)
    # time.monotonic() of its milestones on the engine thread (admitted, first_chunk_emitted,
    # last_chunk_emitted, commit_emitted), for the servicer's log line: where its time went
    marks: dict[str, float] = field(default_factory=dict)


class _PassCancelled(Exception):
    pass


@dataclass(frozen=True)
class _ReturnPages:
    """An inbox item: the pages of a sender's hold owner go back to the pool."""

    owner: str


class PrefillEngine:
    def __init__(self, model: LlamaModel, pool: KvPool, layout: KvLayout, max_batch_tokens: int,
                 log, counters: Counters, send_budget: SendBudget, metrics=None,
                 prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
                 prefix_cache: PrefixCache | None = None,
                 cores: CoreBorrowing | None = None) -> None:
        if max_batch_tokens < 1 or prefill_chunk_tokens < 1:
            raise ValueError(f"max_batch_tokens {max_batch_tokens} and prefill_chunk_tokens "
                             f"{prefill_chunk_tokens} must be >= 1")
        self.model = model
        self._cores = cores or CoreBorrowing(CoreBorrowingConfig())  # decode's idle cores
        self.cache = prefix_cache or PrefixCache(pool, PrefixCacheConfig(enabled=False), counters)
        self._send_budget = send_budget
        self.metrics = metrics if metrics is not None else NullMetrics()
        self.pool = pool
        self.layout = layout
        self.max_batch_tokens = max_batch_tokens  # tokens of one forward pass, all jobs
        self.chunk_tokens = min(prefill_chunk_tokens, max_batch_tokens)  # of one job per pass
        self.log = log
        self.counters = counters
        self._inbox: queue.Queue[PrefillJob | _ReturnPages | None] = queue.Queue()
        self._waiting: deque[PrefillJob] = deque()
        self._jobs: list[PrefillJob] = []  # admitted (pages held), in admission order
        self._running = 0  # len(self._jobs), for other threads; written by the engine thread
        self._thread = threading.Thread(target=self._run, name="prefill-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def submit(self, job: PrefillJob) -> None:
        self._inbox.put(job)

    def return_pages(self, owner: str) -> None:
        """Pages a sender held (KvSender.hold) go back to the pool, poisoned or scrubbed as
        configured, on the engine thread before its next pass (any thread)."""
        self._inbox.put(_ReturnPages(owner))

    def waiting_count(self) -> int:
        return len(self._waiting) + self._inbox.qsize()

    def running_count(self) -> int:
        """Requests admitted and not yet done (their pages are held, their prompt is being
        computed over one or more passes); any thread."""
        return self._running

    def frame_sent(self, job: PrefillJob, nbytes: int) -> None:
        """The servicer handed one of job's frames (nbytes long) to gRPC: its bytes leave the
        send budget."""
        self._send_budget.release(job.unsent, nbytes)

    def stream_ended(self, job: PrefillJob) -> None:
        """job's stream is over (done, cancelled or failed): frames never sent leave the
        budget, and the engine acquires nothing more for it."""
        self._send_budget.close(job.unsent)

    def _run(self) -> None:
        stalled = False  # last round planned nothing: wait for news instead of spinning
        self._cores.on_engine_thread()
        while True:
            idle = not self._waiting and not self._jobs
            try:
                timeout = None if idle else (0.01 if stalled else 0.0)
                item = self._inbox.get(block=idle or stalled, timeout=timeout)
                if item is None:
                    return
                stalled = False
                if isinstance(item, _ReturnPages):  # pages back: a waiting job may fit now
                    self.pool.release(item.owner)
                    continue
                self._waiting.append(item)
                continue  # drain the inbox before planning a pass
            except queue.Empty:
                pass
            try:
                plan = self._plan_pass()
                stalled = not plan
                if plan:
                    self._run_pass(plan)
            except Exception as exc:  # keep the engine alive; _run_pass already freed pages
                self.log.exception("prefill_engine_error", error=str(exc))

    def _plan_pass(self) -> list[ChunkSlice]:
        """The running jobs' next chunks, then new jobs admitted while the budget lasts."""
        self._finish_cancelled()
        plan = plan_running(self._jobs, self.max_batch_tokens, self.chunk_tokens)
        left = self.max_batch_tokens - sum(s.num_tokens for s in plan)
        while self._waiting and left > 0:
            job = self._waiting[0]
            if job.cancelled.is_set():
                self._waiting.popleft()
                job.emit(None)
                continue
            admitted = self._admit(job)
            if admitted is None:  # the pool cannot hold it now
                break
            self._waiting.popleft()
            if admitted:
                piece = next_slice(job, left, self.chunk_tokens)
                plan.append(piece)
                left -= piece.num_tokens
        return plan

    def _admit(self, job: PrefillJob) -> bool | None:
        """Reserves pages for job's whole prompt and makes it running; on failure the job is
        aborted and dropped; None (nothing changed) when the pool cannot hold it now."""
        n = len(job.token_ids)
        try:
            if not 0 <= job.computed_tokens < n:
                raise ValueError(f"computed_tokens {job.computed_tokens} of a {n}-token prompt")
            if self._reserve(job) is False:
                return None
        except Exception as exc:  # e.g. a request id already in flight: abort this one only
            self.log.exception("prefill_allocate_failed", request_id=job.request_id,
                               error=str(exc))
            job.emit(frame_wire(commit_frame(job.request_id, n, 0, 0,
                                             handoff_pb2.HANDOFF_STATUS_ABORTED,
                                             f"could not reserve KV pages: {exc}", job.nonce)))
            job.emit(None)
            return False
        job.marks["admitted"] = time.monotonic()
        self.metrics.queued(job.marks["admitted"] - job.submitted)
        self._jobs.append(job)
        self._running = len(self._jobs)
        return True

    def _reserve(self, job: PrefillJob) -> bool:
        """Allocates the pages of job's whole prompt, borrowing the cached prefix of its scope
        (job.computed_tokens then counts its tokens, whose frames go out with the first chunk)
        and evicting unread cached pages when short; False, changing nothing, when the pool
        cannot hold it now; raises, changing nothing, when it never can."""
        preset = job.computed_tokens  # a prefix the submitter put in place: no lookup then
        cached = self.cache.reserve(job.request_id, job.token_ids,
                                    b"" if preset else job.cache_scope)
        if cached is None:
            return False
        job.computed_tokens = job.cached_tokens = max(preset, cached)
        return True

    def _run_pass(self, plan: list[ChunkSlice]) -> None:
        jobs = [s.job for s in plan]
        try:
            started = time.monotonic()
            with self._cores.prefill_pass(sum(s.num_tokens for s in plan)):
                logits = self._forward(plan)  # [len(plan), vocab]
            self.metrics.prefill(time.monotonic() - started, sum(s.num_tokens for s in plan),
                                 len(plan))
            self.counters.add("forward_passes")
            self.counters.add("prefill_tokens_computed", sum(s.num_tokens for s in plan))
            for piece in plan:
                piece.job.computed_tokens = piece.job.streamed_tokens = piece.end
            done = [(row, s.job) for row, s in enumerate(plan) if s.is_last]
            if done:
                rows = torch.tensor([row for row, _ in done], device=logits.device)
                firsts = sample_batch(logits[rows], [j.sampling for _, j in done],
                                      [0] * len(done))
                for (_, job), first in zip(done, firsts):
                    self._commit(job, first)
                    self._finish(job)
        except _PassCancelled:
            self.log.info("prefill_cancelled", request_ids=[j.request_id for j in jobs])
        except Exception as exc:  # the stream must end with ABORTED, never with partial silence
            self.log.exception("prefill_failed", error=str(exc))
            for job in jobs:
                if job in self._jobs:
                    if not job.cancelled.is_set():
                        job.emit(frame_wire(commit_frame(
                            job.request_id, len(job.token_ids), job.chunks_sent, 0,
                            handoff_pb2.HANDOFF_STATUS_ABORTED, f"prefill failed: {exc}",
                            job.nonce)))
                    self._finish(job)
        finally:
            self._finish_cancelled()

    def _commit(self, job: PrefillJob, first: int) -> None:
        if job.cancelled.is_set():
            return
        job.emit(frame_wire(commit_frame(job.request_id, len(job.token_ids), job.chunks_sent,
                                         first, nonce=job.nonce)))
        job.marks["commit_emitted"] = time.monotonic()
        self._keep_prefix(job)
        self.counters.add("handoffs_completed")
        self.metrics.handoff(time.monotonic() - job.submitted,
                             len(job.token_ids) * self.layout.kv_bytes_per_token)

    def _keep_prefix(self, job: PrefillJob) -> None:
        """job's prompt KV is complete: its whole pages join the cache of its scope."""
        try:
            self.cache.insert(job.request_id, job.token_ids, job.cache_scope)
        except Exception as exc:  # the handoff is done; a cache failure only loses reuse
            self.log.exception("prefix_cache_insert_failed", request_id=job.request_id,
                               error=str(exc))

    def _finish_cancelled(self) -> None:
        for job in [j for j in self._jobs if j.cancelled.is_set()]:
            self._finish(job)

    def _finish(self, job: PrefillJob) -> None:
        """job leaves the engine: its pages are freed (or, when its sender's frames name them,
        held under the owner the sender names until it hands them back: `return_pages`) and
        its stream ends."""
        self._jobs.remove(job)
        self._running = len(self._jobs)
        owner = job.sender.hold(job.request_id)
        try:
            if owner is not None:
                self.pool.allocator.rename(job.request_id, owner)
        except Exception as exc:  # never: the owner is fresh; the pages are freed instead
            self.log.exception("prefill_hold_failed", request_id=job.request_id, error=str(exc))
            owner = None
        if owner is None:
            self.pool.release(job.request_id)
        try:
            job.emit(None)
        except Exception as exc:  # an emit that fails must not keep other jobs' pages
            self.log.exception("prefill_emit_failed", request_id=job.request_id, error=str(exc))

    def _forward(self, plan: list[ChunkSlice]) -> torch.Tensor:
        device = self.model.device
        ids, positions, slots, cu, contexts, tables = [], [], [], [0], [], []
        for piece in plan:
            job = piece.job
            pages = self.pool.allocator.page_table(job.request_id)
            if self.pool.config.check_owners:
                self.pool.allocator.check_write(job.request_id, pages, piece.start)
                self.pool.allocator.check_write(job.request_id, pages, piece.end - 1)
            tables.append(pages)
            ids += job.token_ids[piece.start:piece.end]
            positions += range(piece.start, piece.end)
            slots += self.pool.slots_for(pages, piece.start, piece.end)
            cu.append(cu[-1] + piece.num_tokens)
            contexts.append(piece.start)
        paged = any(contexts)  # else every chunk starts its prompt: plain causal attention
        width = max(len(t) for t in tables)
        prefill = PrefillBatch(
            token_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
            max_seqlen=max(s.num_tokens for s in plan),
            context_lens=(torch.tensor(contexts, dtype=torch.int32, device=device)
                          if paged else None),
            page_table=(torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                     dtype=torch.int32, device=device) if paged else None))
        rows = [torch.tensor(t, dtype=torch.int32, device=device) for t in tables]

        def on_layer_stored(layer: int) -> None:
            live = [(s, r) for s, r in zip(plan, rows) if not s.job.cancelled.is_set()]
            if not live:
                raise _PassCancelled()
            for piece, table in live:
                self._emit_layer(piece.job, table, layer, piece.job.streamed_tokens, piece.end)
            self._cores.prefill_layer()  # decode got busy: the rest of the pass on its own

        return self.model.prefill(prefill, self.pool.k, self.pool.v, on_layer_stored)

    def _emit_layer(self, job: PrefillJob, table: torch.Tensor, layer: int, token_start: int,
                    token_end: int) -> None:
        """Frames of layer's KV for tokens [token_start, token_end) of job, at most
        job.chunk_tokens tokens each, split where its sender's `spans` say."""
        ops = self.model.ops
        for start, count in job.sender.spans(table, token_start, token_end, job.chunk_tokens):
            kv = job.sender.pack(ops, self.pool.k[layer], self.pool.v[layer], table, start,
                                 count)
            frame = job.sender.chunk(job.request_id, job.chunks_sent, layer, start, kv,
                                     job.nonce)
            if frame is None or not self._send_budget.acquire(job.unsent, len(frame),
                                                              job.cancelled):
                job.cancelled.set()  # the stream is gone: no later chunk, no commit
                return
            job.emit(frame)
            job.chunks_sent += 1
            job.marks["last_chunk_emitted"] = time.monotonic()
            job.marks.setdefault("first_chunk_emitted", job.marks["last_chunk_emitted"])
