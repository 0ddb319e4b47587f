"""A request id already holding pages aborts only the duplicate job: its stream ends with an
ABORTED commit, the other completes, and no page leaks (deterministic, in-process)."""

from __future__ import annotations

import io
import threading

import torch

from common.config import PrefillConfig, ServiceConfig
from common.counters import Counters
from common.handoff.layout import KvLayout
from common.kvpool.kv_cache import KvPool, PoolConfig
from common.log import make_logger
from common.model.llama import LlamaModel
from common.model.loader import load_model
from common.ops.torch_ops import TorchOps
from common.pb.kvhandoff.v1 import handoff_pb2
from common.sampling import SamplingConfig
from prefill_svc.engine import PrefillEngine, PrefillJob
from prefill_svc.send_budget import SendBudget


def test_duplicate_request_id_in_one_batch_aborts_the_duplicate_only():
    loaded = load_model("demo")
    c = loaded.config
    model = LlamaModel(c, loaded.weights, TorchOps(), torch.device("cpu"), torch.float32)
    pool = KvPool(PoolConfig(pool_tokens=256, page_size=16), c.num_layers, c.num_kv_heads,
                  c.head_dim, torch.float32, torch.device("cpu"))
    layout = KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32)
    engine = PrefillEngine(model, pool, layout, 4096, make_logger("prefill", stream=io.StringIO()),
                           Counters(), SendBudget(PrefillConfig(ServiceConfig()).max_unsent_bytes))
    streams: list[list] = [[], []]
    ended = [threading.Event(), threading.Event()]

    def emitter(i: int):
        def emit(frame) -> None:
            if frame is None:
                ended[i].set()
            else:
                streams[i].append(handoff_pb2.PrefillResponse.FromString(frame))
        return emit

    for i in range(2):  # both queued before the engine starts: they form one batch
        engine.submit(PrefillJob("same-id", [5, 6, 7, 8], SamplingConfig(), 64, emitter(i)))
    engine.start()
    try:
        assert all(e.wait(60) for e in ended)
        commits = [s[-1].commit for s in streams]
        assert [c.status for c in commits] == [handoff_pb2.HANDOFF_STATUS_OK,
                                               handoff_pb2.HANDOFF_STATUS_ABORTED]
        assert "could not reserve KV pages" in commits[1].reason
        assert [f.WhichOneof("frame") for f in streams[1]] == ["commit"]
        snap = pool.allocator.snapshot()
        assert snap.pages_free == snap.pages_total
    finally:
        engine.stop()
