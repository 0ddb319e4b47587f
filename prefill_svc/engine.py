"""The prefill engine thread: owns the model and the pool, runs batches of prompts, and emits
each layer's KV as chunks as soon as that layer is stored.

Invariants: a job's pages are allocated before its forward pass and freed after its commit or
abort, whatever happens; a cancelled job gets no more frames; compute never runs on the event
loop (servicers only call `submit`). Frames leave this thread already serialized (the protobuf
encoding of a PrefillResponse, crc32c included), so the event loop only hands bytes to gRPC.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.counters import Counters
from common.handoff.codec import commit_frame, frame_wire
from common.handoff.layout import KvLayout
from common.kvpool.kv_cache import KvPool
from common.metrics import NullMetrics
from common.model.llama import LlamaModel, PrefillBatch
from common.pb.kvhandoff.v1 import handoff_pb2
from common.sampling import SamplingConfig, sample_batch
from prefill_svc.kv_sender import InlineSender, KvSender
from prefill_svc.send_budget import JobBytes, SendBudget


@dataclass
class PrefillJob:
    """emit(frame) is thread-safe; frame is a serialized PrefillResponse; emit(None) ends the
    job's stream."""

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


class _BatchCancelled(Exception):
    pass


class PrefillEngine:
    def __init__(self, model: LlamaModel, pool: KvPool, layout: KvLayout, max_batch_tokens: int,
                 log, counters: Counters, send_budget: SendBudget, metrics=None) -> None:
        self.model = model
        self._send_budget = send_budget
        self.metrics = metrics if metrics is not None else NullMetrics()
        self.pool = pool
        self.layout = layout
        self.max_batch_tokens = max_batch_tokens
        self.log = log
        self.counters = counters
        self._inbox: queue.Queue[PrefillJob | None] = queue.Queue()
        self._waiting: deque[PrefillJob] = deque()
        self._running = 0  # jobs in the batch being computed; written by the engine thread only
        self._thread = threading.Thread(target=self._run, name="prefill-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def submit(self, job: PrefillJob) -> None:
        self._inbox.put(job)

    def waiting_count(self) -> int:
        return len(self._waiting) + self._inbox.qsize()

    def running_count(self) -> int:
        """Requests in the batch being computed now (their pages are held); any thread."""
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
        while True:
            block = not self._waiting
            try:
                item = self._inbox.get(block=block, timeout=None if block else 0.0)
                if item is None:
                    return
                self._waiting.append(item)
                continue  # drain the inbox before forming a batch
            except queue.Empty:
                pass
            try:
                batch = self._take_batch()
                if batch:
                    self._run_batch(batch)
            except Exception as exc:  # keep the engine alive; _run_batch already freed pages
                self.log.exception("prefill_engine_error", error=str(exc))

    def _take_batch(self) -> list[PrefillJob]:
        batch: list[PrefillJob] = []
        tokens = 0
        while self._waiting:
            job = self._waiting[0]
            if job.cancelled.is_set():
                self._waiting.popleft()
                job.emit(None)
                continue
            n = len(job.token_ids)
            if batch and tokens + n > self.max_batch_tokens:
                break
            if not self.pool.allocator.can_allocate(n):
                break
            self._waiting.popleft()
            try:
                self.pool.allocator.allocate(job.request_id, n)
            except Exception as exc:  # e.g. a request id already in flight: abort this one only
                self.log.exception("prefill_allocate_failed", request_id=job.request_id,
                                   error=str(exc))
                job.emit(frame_wire(commit_frame(job.request_id, n, 0, 0,
                                                 handoff_pb2.HANDOFF_STATUS_ABORTED,
                                                 f"could not reserve KV pages: {exc}",
                                                 job.nonce)))
                job.emit(None)
                continue
            self.metrics.queued(time.monotonic() - job.submitted)
            batch.append(job)
            tokens += n
        return batch

    def _run_batch(self, batch: list[PrefillJob]) -> None:
        self._running = len(batch)
        try:
            started = time.monotonic()
            logits = self._forward(batch)
            self.metrics.prefill(time.monotonic() - started,
                                 sum(len(j.token_ids) for j in batch), len(batch))
            self.counters.add("forward_passes")
            firsts = sample_batch(logits, [j.sampling for j in batch], [0] * len(batch))
            for job, first in zip(batch, firsts):
                if not job.cancelled.is_set():
                    job.emit(frame_wire(commit_frame(job.request_id, len(job.token_ids),
                                                     job.chunks_sent, first, nonce=job.nonce)))
                    self.counters.add("handoffs_completed")
                    self.metrics.handoff(time.monotonic() - job.submitted,
                                         len(job.token_ids) * self.layout.kv_bytes_per_token)
        except _BatchCancelled:
            self.log.info("prefill_cancelled", request_ids=[j.request_id for j in batch])
        except Exception as exc:  # the stream must end with ABORTED, never with partial silence
            self.log.exception("prefill_failed", error=str(exc))
            for job in batch:
                if not job.cancelled.is_set():
                    job.emit(frame_wire(commit_frame(
                        job.request_id, len(job.token_ids), job.chunks_sent, 0,
                        handoff_pb2.HANDOFF_STATUS_ABORTED, f"prefill failed: {exc}",
                        job.nonce)))
        finally:
            self._running = 0
            for job in batch:
                self.pool.release(job.request_id)
                try:
                    job.emit(None)
                except Exception as exc:  # an emit that fails must not keep other jobs' pages
                    self.log.exception("prefill_emit_failed", request_id=job.request_id,
                                       error=str(exc))

    def _forward(self, batch: list[PrefillJob]) -> torch.Tensor:
        device = self.model.device
        ids, positions, slots, cu = [], [], [], [0]
        tables = []
        for job in batch:
            n = len(job.token_ids)
            pages = self.pool.allocator.page_table(job.request_id)
            if self.pool.config.check_owners:
                self.pool.allocator.check_write(job.request_id, pages, n - 1)
            tables.append(torch.tensor(pages, dtype=torch.int32, device=device))
            ids += job.token_ids
            positions += range(n)
            slots += self.pool.slots_for(pages, 0, n)
            cu.append(cu[-1] + n)
        prefill = PrefillBatch(
            token_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
            max_seqlen=max(len(j.token_ids) for j in batch))

        def on_layer_stored(layer: int) -> None:
            live = [(j, t) for j, t in zip(batch, tables) if not j.cancelled.is_set()]
            if not live:
                raise _BatchCancelled()
            for job, table in live:
                self._emit_layer(job, table, layer)

        return self.model.prefill(prefill, self.pool.k, self.pool.v, on_layer_stored)

    def _emit_layer(self, job: PrefillJob, table: torch.Tensor, layer: int) -> None:
        n = len(job.token_ids)
        ops = self.model.ops
        for start in range(0, n, job.chunk_tokens):
            count = min(job.chunk_tokens, n - start)
            kv = job.sender.pack(ops, self.pool.k[layer], self.pool.v[layer], table, start,
                                 count)
            frame = job.sender.chunk(job.request_id, job.chunks_sent, layer, start, kv,
                                     job.nonce)
            if frame is None:
                return  # released: the stream is gone; the next layer boundary drops the job
            if not self._send_budget.acquire(job.unsent, len(frame), job.cancelled):
                return  # the stream is gone; the next layer boundary drops the job
            job.emit(frame)
            job.chunks_sent += 1
