"""Runs a real PrefillEngine in-process on a model and collects each job's frames, and puts a
handoff's chunks back together as KV [L, n, Hkv, D] (checking every (layer, token) arrives
exactly once)."""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from common.counters import Counters
from common.handoff.layout import KvLayout
from common.kvpool.kv_cache import KvPool, PoolConfig
from common.log import make_logger
from common.pb.kvhandoff.v1 import handoff_pb2
from common.sampling import SamplingConfig
from prefill_svc.engine import PrefillEngine, PrefillJob
from prefill_svc.send_budget import SendBudget

PAGE = 16


@dataclass
class JobRun:
    frames: list[handoff_pb2.PrefillResponse] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)

    @property
    def chunks(self) -> list[handoff_pb2.KvChunk]:
        return [f.chunk for f in self.frames if f.WhichOneof("frame") == "chunk"]

    @property
    def commit(self) -> handoff_pb2.HandoffCommit | None:
        commits = [f.commit for f in self.frames if f.WhichOneof("frame") == "commit"]
        assert len(commits) <= 1
        return commits[0] if commits else None


@dataclass
class EngineRun:
    jobs: list[JobRun]
    pool: KvPool
    counters: Counters


def layout_of(model) -> KvLayout:
    c = model.config
    return KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, model.dtype)


def run_engine(model, prompts: list[list[int]], *, max_batch_tokens: int, chunk: int,
               frame_tokens: int = 10, pool_tokens: int = 4096, engine_cls=PrefillEngine,
               computed: list[int] | None = None, on_frame=None, timeout: float = 120
               ) -> EngineRun:
    """Submits every prompt before the engine starts, runs until each stream ends.
    on_frame(job index, frame, job) runs on the engine thread after a frame is recorded."""
    c = model.config
    pool = KvPool(PoolConfig(pool_tokens=pool_tokens, page_size=PAGE, check_owners=True),
                  c.num_layers, c.num_kv_heads, c.head_dim, model.dtype, model.device)
    counters = Counters()
    engine = engine_cls(model, pool, layout_of(model), max_batch_tokens,
                        make_logger("prefill", stream=io.StringIO()), counters,
                        SendBudget(256 << 20), prefill_chunk_tokens=chunk)
    runs = [JobRun() for _ in prompts]
    jobs: list[PrefillJob] = []

    def emitter(i: int):
        def emit(frame: bytes | None) -> None:
            if frame is None:
                runs[i].ended.set()
                return
            runs[i].frames.append(handoff_pb2.PrefillResponse.FromString(frame))
            if on_frame is not None:
                on_frame(i, runs[i].frames[-1], jobs[i])
        return emit

    for i, prompt in enumerate(prompts):
        job = PrefillJob(f"r{i}", list(prompt), SamplingConfig(), frame_tokens, emitter(i),
                         nonce=bytes(16))
        if computed is not None:
            job.computed_tokens = computed[i]
        jobs.append(job)
        engine.submit(job)
    engine.start()
    try:
        assert all(r.ended.wait(timeout) for r in runs), "a stream never ended"
    finally:
        engine.stop()
    return EngineRun(runs, pool, counters)


def assemble(chunks, layout: KvLayout, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> K, V [L, n, Hkv, D] float32 from chunks; asserts every (layer, token) exactly once."""
    shape = (layout.num_layers, num_tokens, layout.num_kv_heads, layout.head_dim)
    k, v = torch.zeros(shape), torch.zeros(shape)
    seen = torch.zeros(layout.num_layers, num_tokens, dtype=torch.int32)
    for chunk in chunks:
        n = chunk.token_end - chunk.token_start
        rows = slice(chunk.token_start, chunk.token_end)
        k[chunk.layer, rows] = _tensor(chunk.k, n, layout)
        v[chunk.layer, rows] = _tensor(chunk.v, n, layout)
        seen[chunk.layer, rows] += 1
    assert bool((seen == 1).all()), "some (layer, token) missing or sent twice"
    return k, v


def _tensor(data: bytes, n: int, layout: KvLayout) -> torch.Tensor:
    assert layout.dtype == torch.float32
    array = np.frombuffer(data, dtype="<f4").reshape(n, layout.num_kv_heads, layout.head_dim)
    return torch.from_numpy(array.copy())


def pool_at_baseline(pool: KvPool) -> bool:
    snap = pool.allocator.snapshot()
    return snap.pages_free == snap.pages_total
