"""The decode engine thread: owns the pool and the model; admits, writes received KV, steps
every running sequence in one batch, and retires finished ones.

Commands arrive on one queue and run in order, so a `release` always follows the writes of the
same request, and pages return to the free list only after every copy into them is done.
Invariants: a sequence joins the batch only after `start` (its handoff was verified and all its
KV written); with check_owners on, every batch's page table is checked against the owners before
the step, and a sequence that fails is failed alone.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Collection

import grpc
import numpy as np
import torch

from common.counters import Counters
from common.errors import ServiceError
from common.kvpool.allocator import PageOwnershipError
from common.handoff.codec import bytes_to_kv
from common.handoff.layout import KvLayout
from common.kernels.pack_kv import unpack_kv_bytes_cpu
from common.kvpool.kv_cache import KvPool
from common.model.llama import DecodeBatch, LlamaModel
from common.sampling import SamplingConfig, sample_batch
from common.server.core_borrowing import CoreBorrowing, CoreBorrowingConfig
from decode_svc.content_check import (ContentCheckConfig, FiniteTracker, check_content,
                                      refusal_if_not_finite)
from decode_svc.engine_commands import (AfterWrites, Begin, Landed, NewAttempt, Release,
                                        Reserve, Stop, Verify, Write, WriteBytes)
from decode_svc.finite_bits import all_finite_bytes, all_finite_pieces
from decode_svc.full_audit import FullAudit
from decode_svc.sequence import FailedEvent, FinishedEvent, Sequence, TokenEvent


COMMANDS_PER_STEP = 64


class DecodeEngine:
    def __init__(self, model: LlamaModel, pool: KvPool, max_batch: int, max_waiting: int,
                 log, counters: Counters,
                 content_checks: ContentCheckConfig | None = None,
                 cores: CoreBorrowing | None = None) -> None:
        self.model = model
        self._cores = cores or CoreBorrowing(CoreBorrowingConfig())  # prefill's idle cores
        self._awaiting_kv: set[str] = set()  # pages reserved, KV not yet all here
        self._joining: set[str] = set()  # content checked or being checked, not yet begun
        self.content_checks = content_checks or ContentCheckConfig()
        self._finite = FiniteTracker()
        self._rng = random.SystemRandom()  # the depth positions are drawn after the KV arrived
        self._audit = FullAudit(self.content_checks.full_fraction, self._rng, counters, log)
        self.pool = pool
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.log = log
        self.counters = counters
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: deque[Reserve] = deque()
        self._running: dict[str, Sequence] = {}
        self._write_failed: set[str] = set()
        self._stopping = False
        self._on_step: Callable[[float, int, int], None] | None = None
        self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)
        self._handlers: dict[type, Callable[[object], None]] = {
            Reserve: self._on_reserve, Write: self._on_write, WriteBytes: self._on_write_bytes,
            Landed: self._on_landed, AfterWrites: self._on_after_writes, Verify: self._on_verify,
            Begin: self._on_begin, NewAttempt: self._on_new_attempt, Release: self._on_release}

    # ---- called from the event loop (thread-safe) ----
    def observe_steps(self, on_step: Callable[[float, int, int], None]) -> None:
        """Before start: on_step(seconds, rows, threads) after every step of the running batch,
        on the engine thread (it must be quick and must not raise)."""
        self._on_step = on_step

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.submit(Stop())
        self._thread.join(timeout=30)

    def submit(self, command: object) -> None:
        """Queues one typed command (decode_svc.engine_commands); a type this engine has no
        handler for raises TypeError here, in the caller's thread, and is never queued."""
        if type(command) is not Stop and type(command) not in self._handlers:
            raise TypeError(f"{type(self).__name__} has no handler for "
                            f"{type(command).__name__}")
        self._inbox.put(command)

    def reserve(self, request_id: str, num_tokens: int, done) -> None:
        """done(pages) once reserved, or done(ServiceError) when the admission queue is full."""
        self.submit(Reserve(request_id, num_tokens, done))

    def write(self, request_id: str, layer: int, token_start: int, kv: torch.Tensor) -> None:
        """kv: [2, n, Hkv, D] on the CPU; ignored if the request no longer holds pages."""
        self.submit(Write(request_id, layer, token_start, kv))

    def write_bytes(self, request_id: str, layer: int, token_start: int, num_tokens: int,
                    k: np.ndarray, v: np.ndarray) -> None:
        """A verified chunk's K and V bytes as received (decode's own copy, never a buffer a
        peer can still change); ignored if the request no longer holds pages."""
        self.submit(WriteBytes(request_id, layer, token_start, num_tokens, k, v))

    def landed(self, request_id: str, pieces: tuple) -> None:
        """A verified chunk already in the request's pages (decode_svc.page_landing); pieces:
        its uint8 views there."""
        self.submit(Landed(request_id, pieces))

    def after_writes(self, then) -> None:
        """then() on the engine thread after every command queued so far."""
        self.submit(AfterWrites(then))

    def peer_borrowing(self) -> bool:
        """Whether prefill computes a pass on this service's CPUs now (core borrowing)."""
        return self._cores.peer_borrowing()

    def verify(self, request_id: str, token_ids: list[int], sampling: SamplingConfig,
               done, prepared=None) -> None:
        """After every write of the request's handoff: checks the KV content in its pages
        (content_check; prepared: its ContentPipeline, the checks run as the KV landed);
        done(ContentVerdict) or done(HandoffRefused / ServiceError)."""
        self.submit(Verify(request_id, token_ids, sampling, done, prepared))

    def begin(self, seq: Sequence) -> None:
        """The handoff of seq was verified and its writes queued: join the running batch."""
        self.submit(Begin(seq))

    def new_attempt(self, request_id: str, done) -> None:
        """A retry's handoff will write into the request's pages: forget what the earlier
        attempts' writes recorded; done(None) after every command queued before this one."""
        self.submit(NewAttempt(request_id, done))

    def release(self, request_id: str) -> None:
        """Frees whatever the request holds or waits for; safe to call more than once."""
        self.submit(Release(request_id))

    def running_count(self) -> int:
        return len(self._running)

    def is_idle(self, landing: Collection[str]) -> bool:
        """Whether the engine has nothing to do but prefills it may run itself: no sequence
        running or waiting for pages, none being checked or joining, and none of `landing`
        (requests whose KV a peer is sending) still awaited; a request that reserved pages and
        whose KV nobody sends (not routed yet, or computed here) does not count. A hint read
        from any thread (each read is one atomic look at a container the engine thread
        changes)."""
        return (not self._running and not self._waiting and not self._joining
                and self._awaiting_kv.isdisjoint(landing))

    def waiting_count(self) -> int:
        return len(self._waiting)

    # ---- the engine thread ----
    def _run(self) -> None:
        """Alternates: up to COMMANDS_PER_STEP queued commands, then one step of the running
        batch, so a long handoff's writes never freeze the sequences already generating."""
        self._cores.on_engine_thread()
        while True:
            handled = 0
            while handled < COMMANDS_PER_STEP:
                try:
                    command = self._inbox.get(block=handled == 0 and not self._running
                                              and not self._has_pending_work())
                except queue.Empty:
                    break
                if type(command) is Stop:
                    return
                handled += 1
                try:
                    self._handlers[type(command)](command)
                except Exception as exc:  # keep the engine alive; fail only that request
                    self.log.exception("engine_command_failed",
                                       command=type(command).__name__, error=str(exc))
            try:
                self._after_commands()
            except Exception as exc:  # keep the engine alive
                self.log.exception("engine_round_failed", error=str(exc))
            self._cores.decode_state(computing=bool(self._running),
                                     awaiting=bool(self._awaiting_kv))
            if self._running:
                try:
                    rows, threads = len(self._running), torch.get_num_threads()
                    started = time.perf_counter()
                    self._step_or_fail()
                    seconds = time.perf_counter() - started
                    self._cores.step_done(seconds)
                    if self._on_step is not None:
                        self._on_step(seconds, rows, threads)
                except Exception as exc:  # even a failing failure path must not kill the thread
                    self.log.exception("decode_engine_error", error=str(exc))

    def _has_pending_work(self) -> bool:
        """Whether _after_commands has work left from earlier rounds (the loop must not block
        on the queue then); a subclass's hook."""
        return False

    def _after_commands(self) -> None:
        """Runs on the engine thread after each round of queued commands, before the step: the
        place for work gathered from several commands of the round (a subclass's hook)."""

    def _on_reserve(self, res: Reserve) -> None:
        if not self._waiting and self.pool.allocator.can_allocate(res.num_tokens):
            self._grant(res)
        elif len(self._waiting) >= self.max_waiting:
            res.done(ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "ADMISSION_QUEUE_FULL",
                                  f"{self.max_waiting} requests already wait for KV pages; "
                                  f"retry later"))
        else:
            self._waiting.append(res)

    def _admit_waiting(self) -> None:
        while self._waiting and self.pool.allocator.can_allocate(self._waiting[0].num_tokens):
            self._grant(self._waiting.popleft())

    def _grant(self, res: Reserve) -> None:
        """Allocates res's pages and answers it; an allocator error answers INTERNAL, so no
        caller waits forever for a reservation."""
        try:
            pages = self.pool.allocator.allocate(res.request_id, res.num_tokens)
        except Exception as exc:
            self.log.exception("reserve_failed", request_id=res.request_id, error=str(exc))
            res.done(ServiceError(grpc.StatusCode.INTERNAL, "RESERVE_FAILED",
                                  f"could not reserve KV pages: {exc}"))
            return
        self._awaiting_kv.add(res.request_id)
        self._cores.decode_state(computing=bool(self._running), awaiting=True)
        res.done(pages)

    def _on_write(self, command: Write) -> None:
        request_id, layer, token_start, kv = (command.request_id, command.layer,
                                              command.token_start, command.kv)
        if not self.pool.allocator.holds(request_id):
            return
        try:
            table = torch.tensor(self.pool.allocator.page_table(request_id), dtype=torch.int32,
                                 device=self.model.device)
            buffer = kv.to(self.model.device, non_blocking=True)
            self._finite.observe(request_id, buffer)
            self.model.ops.unpack_kv(buffer, self.pool.k[layer], self.pool.v[layer], table,
                                     token_start)
        except Exception as exc:  # fail closed: this request must never decode over these pages
            self._write_failed.add(request_id)
            self.log.exception("kv_write_failed", request_id=request_id, layer=layer,
                               error=str(exc))

    def _on_write_bytes(self, command: WriteBytes) -> None:
        """CPU pools: one copy from the received bytes into the pages (no tensor in between)
        and the finiteness check on those bytes; other devices: the tensor path of Write."""
        request_id, layer = command.request_id, command.layer
        if not self.pool.allocator.holds(request_id):
            return
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        try:
            if k_cache.device.type != "cpu":
                layout = KvLayout(self.pool.k.shape[0], k_cache.shape[2], k_cache.shape[3],
                                  k_cache.dtype)
                kv = bytes_to_kv(layout, command.k, command.v, command.num_tokens)
                self._on_write(Write(request_id, layer, command.token_start, kv))
                return
            table = self.pool.allocator.page_table(request_id)
            self._finite.observe_result(request_id, all_finite_bytes(command.k, k_cache.dtype)
                                        and all_finite_bytes(command.v, k_cache.dtype))
            unpack_kv_bytes_cpu(command.k, command.v, k_cache, v_cache, table,
                                command.token_start, command.num_tokens)
        except Exception as exc:  # fail closed: this request must never decode over these pages
            self._write_failed.add(request_id)
            self.log.exception("kv_write_failed", request_id=request_id, layer=layer,
                               error=str(exc))

    def _on_landed(self, command: Landed) -> None:
        if self.pool.allocator.holds(command.request_id):
            self._finite.observe_result(command.request_id,
                                        all_finite_pieces(command.pieces, self.pool.k.dtype))

    def _on_after_writes(self, command: AfterWrites) -> None:
        try:
            command.then()
        except Exception as exc:  # a hook's failure never stops the engine
            self.log.exception("after_writes_failed", error=str(exc))

    def _unusable_pages(self, request_id: str) -> ServiceError | None:
        """Why the request's pages cannot be read: released, or a KV write into them failed."""
        if not self.pool.allocator.holds(request_id):
            return ServiceError(grpc.StatusCode.INTERNAL, "RESERVATION_LOST",
                                "the request's KV pages were released")
        if request_id in self._write_failed:
            return ServiceError(grpc.StatusCode.INTERNAL, "KV_WRITE_FAILED",
                                "decode could not write the received KV into its pages")
        return None

    def _on_verify(self, job: Verify) -> None:
        """Answers job.done whatever happens, so no handoff waits forever."""
        request_id = job.request_id
        self._awaiting_kv.discard(request_id)
        self._joining.add(request_id)  # until it begins or is released
        self._cores.decode_state(computing=True, awaiting=bool(self._awaiting_kv))
        unusable = self._unusable_pages(request_id)
        if unusable is not None:
            job.done(unusable)
            return
        refusal = refusal_if_not_finite(self._finite, request_id)
        if refusal is not None:
            job.done(refusal)
            return
        try:
            job.done(check_content(self.model, self.pool, request_id, job.token_ids,
                                   job.sampling, self.content_checks, self._rng, self._audit,
                                   job.prepared))
        except ServiceError as err:
            job.done(err)
        except Exception as exc:  # a check that cannot run refuses: fail closed
            self.log.exception("content_check_failed", request_id=request_id, error=str(exc))
            job.done(ServiceError(grpc.StatusCode.INTERNAL, "CONTENT_CHECK_FAILED",
                                  f"decode could not check the received KV: {exc}"))

    def _on_begin(self, command: Begin) -> None:
        seq = command.seq
        self._awaiting_kv.discard(seq.request_id)
        self._joining.discard(seq.request_id)
        unusable = self._unusable_pages(seq.request_id)
        if unusable is not None:
            if unusable.reason == "RESERVATION_LOST":  # released while in flight: nothing held
                seq.emit(FailedEvent(unusable))
            else:
                self._write_failed.discard(seq.request_id)
                self._fail(seq, unusable)
            return
        seq.pages = self.pool.allocator.page_table(seq.request_id)
        self.pool.allocator.mark_written(seq.request_id, seq.prompt_len)
        seq.emit(TokenEvent(seq.tokens[-1], 0))
        if not self._maybe_finish(seq):
            self._running[seq.request_id] = seq

    def _on_new_attempt(self, command: NewAttempt) -> None:
        self._write_failed.discard(command.request_id)
        self._finite.forget(command.request_id)
        command.done(None)

    def _on_release(self, command: Release) -> None:
        request_id = command.request_id
        self._write_failed.discard(request_id)
        self._finite.forget(request_id)
        self._running.pop(request_id, None)
        self._awaiting_kv.discard(request_id)
        self._joining.discard(request_id)
        self._waiting = deque(r for r in self._waiting if r.request_id != request_id)
        self.pool.release(request_id)
        self._admit_waiting()

    def _maybe_finish(self, seq: Sequence) -> bool:
        reason = seq.finish_reason()
        if reason is None:
            return False
        self._running.pop(seq.request_id, None)
        self.pool.release(seq.request_id)
        seq.emit(FinishedEvent(reason, seq.num_generated))
        self._admit_waiting()
        return True

    def _fail(self, seq: Sequence, error: ServiceError) -> None:
        self._running.pop(seq.request_id, None)
        self.pool.release(seq.request_id)
        seq.emit(FailedEvent(error))
        self._admit_waiting()

    def _step_or_fail(self) -> None:
        """One step; if it raises, its batch fails (INTERNAL) and the engine keeps serving."""
        batch = list(self._running.values())[: self.max_batch]
        if self.pool.config.check_owners:
            batch = self._checked(batch)
        if not batch:
            return
        try:
            self._step(batch)
            for seq in batch:  # round robin when more sequences run than max_batch
                if seq.request_id in self._running:
                    self._running[seq.request_id] = self._running.pop(seq.request_id)
        except Exception as exc:
            self.log.exception("decode_step_failed", error=str(exc),
                               request_ids=[s.request_id for s in batch])
            error = ServiceError(grpc.StatusCode.INTERNAL, "DECODE_STEP_FAILED",
                                 f"the decode step failed: {exc}")
            for seq in batch:
                if seq.request_id in self._running:
                    self._fail(seq, error)

    def _step(self, batch: list[Sequence]) -> None:
        device = self.model.device
        max_pages = max(len(s.pages) for s in batch)
        positions = [len(seq.tokens) - 1 for seq in batch]
        slots = [self.pool.slots_at(seq.pages, (pos,))[0]
                 for seq, pos in zip(batch, positions, strict=True)]
        table = torch.tensor([seq.pages + [0] * (max_pages - len(seq.pages)) for seq in batch],
                             dtype=torch.int32)  # [B, max_pages], zero past each row's pages
        step = DecodeBatch(
            token_ids=torch.tensor([s.tokens[-1] for s in batch], dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            page_table=table.to(device),
            seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=device))
        logits = self.model.decode(step, self.pool.k, self.pool.v)
        self.counters.add("decode_steps")
        tokens = sample_batch(logits, [s.sampling for s in batch], [s.num_generated for s in batch])
        for seq, pos, token in zip(batch, positions, tokens, strict=True):
            self.pool.allocator.mark_written(seq.request_id, pos + 1)
            seq.tokens.append(token)
            seq.emit(TokenEvent(token, seq.num_generated - 1))
            self._maybe_finish(seq)

    def _checked(self, batch: list[Sequence]) -> list[Sequence]:
        """Drops (and fails) any sequence whose pages are not its own or not written."""
        good = []
        for seq in batch:
            pos = len(seq.tokens) - 1  # this step reads tokens [0, pos) and writes token pos
            try:
                self.pool.allocator.check_read(seq.request_id, seq.pages, pos)
                self.pool.allocator.check_write(seq.request_id, seq.pages, pos)
                good.append(seq)
            except PageOwnershipError as exc:
                self.log.error("page_ownership_violation", request_id=seq.request_id,
                               error=str(exc))
                self._fail(seq, ServiceError(
                    grpc.StatusCode.INTERNAL, "PAGE_OWNERSHIP_VIOLATION",
                    f"refused to touch KV that is not this request's: {exc}"))
        return good
