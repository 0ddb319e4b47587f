"""The content checks of D-46/D-47 run layer by layer while the handoff lands, instead of after
the commit: layer l's part runs on the engine thread as soon as every token of layer l is in the
pages, so it overlaps prefill's pass over the later layers and only the last layer's part and
the logits are left when the commit arrives.

Per handoff attempt (one `ContentPipeline`, created before its first chunk):
- `on_chunk` (event loop) counts each verified chunk's tokens per layer; when layer `cursor`
  is complete (D-16 forbids overlap, so n tokens counted is every token), it queues
  `_stage(cursor)` behind that layer's writes (`engine.after_writes`: the engine runs it after
  every write queued before it, so the pages hold the layer);
- stage 0 draws the depth positions (unguessable, `random.SystemRandom`, never sent anywhere:
  prefill has already sent what it sent for them, or sends it without a way to know them),
  recomputes layer 0's K/V of decode's own prompt and measures it against the pages (D-46),
  and starts the depth rows (the last position and `depth_positions` others): their embedding;
- stage l runs the depth rows through layer l over layer l's received KV, exactly the layer of
  `LlamaModel.decode` (its own pieces: `_layer`, `_qkv`, the ops' store and decode attention),
  and measures prefill's K/V at the rows' slots against decode's own (D-47, the measure of
  the checks after the commit, `content_check._depth_compare`);
- after the last layer, the logits of the rows (the last position first, D-48).
The verdict (`check_content` with `prepared`) is only drawn after the commit was verified and
the KV found finite, in the order the SPEC gives, so a refusal's reason is the one the checks
run after the commit would give.

Invariants: touches only the request's own pages and only slots its handoff covered; each stage
writes the rows' own K/V into their slots for its attention and puts prefill's values back
before it returns, so between stages the pages hold exactly what arrived (the audit, D-49, reads
them after); a stage whose request no longer holds its pages does nothing; any failure marks the
pipeline failed and `check_content` then runs the checks in full over the pages (fail safe,
never skipped). `complete` only when every layer's stage ran in order. While prefill computes
a pass on decode's CPUs (core borrowing: `engine.peer_borrowing()`), a stage does not run
beside it and the pipeline is `deferred`: the checks run in full after the commit instead.
"""

from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F

from common.kvpool.kv_cache import KvPool
from common.model.llama import LlamaModel
from decode_svc import content_check


class ContentPipeline:
    def __init__(self, engine, request_id: str, token_ids: list[int], depth_positions: int,
                 rng: random.Random | None = None) -> None:
        self.engine = engine  # decode_svc.engine.DecodeEngine: model, pool, after_writes
        self.request_id = request_id
        self.token_ids = token_ids
        self.depth_positions = depth_positions
        self._rng = rng or random.SystemRandom()
        self._landed = [0] * engine.pool.k.shape[0]  # tokens landed per layer
        self._queued = 0  # stages queued (layers 0.. _queued-1)
        self.cursor = 0  # stages run
        self.failed = False
        self.deferred = False  # a stage met prefill borrowing decode's CPUs: checks in full
        self.seconds = 0.0  # engine time the stages took
        self.done_at: float | None = None  # time.monotonic() when the last stage ended
        self.layer0_error = float("nan")
        self.positions: list[int] = []
        self.depth_errors: list[float] = []  # per layer, content_check._depth_compare's
        self._x = self._residual = None
        self.logits: torch.Tensor | None = None  # [m, vocab] float32, the last position first

    @property
    def num_layers(self) -> int:
        return len(self._landed)

    @property
    def complete(self) -> bool:
        return not self.failed and self.cursor == self.num_layers and self.logits is not None

    # ---- event loop ----
    def on_chunk(self, chunk) -> None:
        """A verified chunk (layer, token_start, token_end) whose writes are queued."""
        self._landed[chunk.layer] += chunk.token_end - chunk.token_start
        n = len(self.token_ids)
        while self._queued < self.num_layers and self._landed[self._queued] >= n:
            self.engine.after_writes(self._stage_runner(self._queued))
            self._queued += 1

    def _stage_runner(self, layer: int):
        def run() -> None:
            if self.failed or self.cursor != layer:
                self.failed = True
                return
            if not self.engine.pool.allocator.holds(self.request_id):
                self.failed = True  # released while landing: nothing to check any more
                return
            if self.engine.peer_borrowing():
                self.failed = self.deferred = True  # leave the CPUs to prefill's pass
                self.engine.counters.add("content_checks_deferred")
                return
            started = time.perf_counter()
            try:
                self._stage(layer)
                self.cursor += 1
            except Exception:
                self.failed = True
                raise  # the engine logs it (after_writes_failed); check_content runs in full
            finally:
                self.seconds += time.perf_counter() - started
        return run

    # ---- engine thread ----
    @torch.inference_mode()
    def _stage(self, layer: int) -> None:
        model: LlamaModel = self.engine.model
        pool: KvPool = self.engine.pool
        device = model.device
        pages = pool.allocator.page_table(self.request_id)
        table = torch.tensor(pages, dtype=torch.int32, device=device)  # [P]
        n = len(self.token_ids)
        if layer == 0:
            self._start(model, pool, pages, table, n)
        k_layer, v_layer = pool.k[layer], pool.v[layer]  # [P, S, Hkv, D]
        sent = self._gather(k_layer, v_layer)  # [2, m, Hkv, D]: prefill's, before the step

        def attend(at: int, h: torch.Tensor) -> torch.Tensor:
            q, k, v = model._qkv(at, h, self._where)
            model.ops.store_kv(k, v, k_layer, v_layer, self._slots)
            out = model.ops.decode_attention(q, k_layer, v_layer, self._tables, self._seq_lens,
                                             model.scale)
            return out.reshape(out.shape[0], -1)

        try:
            self._x, self._residual = model._layer(layer, self._x, self._residual, attend)
            mine = self._gather(k_layer, v_layer)  # [2, m, Hkv, D]: decode's own
            self.depth_errors.append(content_check._depth_compare((sent,), (mine,))[0])
        finally:  # prefill's values back, whatever failed: the pages hold what arrived
            k_layer.flatten(0, 1).index_copy_(0, self._slots, sent[0])
            v_layer.flatten(0, 1).index_copy_(0, self._slots, sent[1])
        if layer == self.num_layers - 1:
            self.logits = model._logits(self._x, self._residual)
            self._x = self._residual = None
            self.done_at = time.monotonic()

    def _start(self, model: LlamaModel, pool: KvPool, pages: list[int], table: torch.Tensor,
               n: int) -> None:
        device = model.device
        ids = torch.tensor(self.token_ids, dtype=torch.int64, device=device)  # [n]
        # the measure of the checks after the commit, looked up at call time (one definition)
        self.layer0_error = content_check._layer0_error(model, pool, table, ids)
        others = self._rng.sample(range(n - 1), min(self.depth_positions, n - 1))
        self.positions = [n - 1, *sorted(others)]
        self._slots = torch.tensor(pool.slots_at(pages, self.positions), dtype=torch.int64,
                                   device=device)  # [m]
        self._where = torch.tensor(self.positions, dtype=torch.int64, device=device)  # [m]
        self._tables = table.unsqueeze(0).expand(len(self.positions), -1).contiguous()
        self._seq_lens = (self._where + 1).to(torch.int32)  # [m]
        self._x = F.embedding(ids[self._where], model.w["model.embed_tokens.weight"])  # [m, H]
        self._residual = None

    def _gather(self, k_layer: torch.Tensor, v_layer: torch.Tensor) -> torch.Tensor:
        """-> [2, m, Hkv, D]: K and V of the rows' slots in one layer (a copy)."""
        return torch.stack((k_layer.flatten(0, 1)[self._slots],
                            v_layer.flatten(0, 1)[self._slots]))
