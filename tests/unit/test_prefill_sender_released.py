"""A job whose sender was released while its batch still runs (its stream ended on the event loop
before the engine saw the cancel) gets no more frames, and never aborts the other jobs of its
batch; on both planes (in-process, deterministic)."""

from __future__ import annotations

import io
import threading

import pytest
import torch

from common.counters import Counters
from common.handoff.layout import KvLayout
from common.kvpool.kv_cache import KvPool, PoolConfig
from common.log import make_logger
from common.model.llama import LlamaModel
from common.model.loader import load_model
from common.ops.torch_ops import TorchOps
from common.pb.kvhandoff.v1 import handoff_pb2
from common.sampling import SamplingConfig
from prefill_svc.send_budget import SendBudget
from prefill_svc.engine import PrefillEngine, PrefillJob
from prefill_svc.kv_sender import InlineSender
from prefill_svc.shm_sender import SharedMemorySender

PROMPTS = ([5, 6, 7, 8, 9, 10], [11, 12, 13, 14])


@pytest.mark.parametrize("plane", ["inline", "shared-memory"])
def test_a_released_job_does_not_abort_its_batch(plane, tmp_path):
    loaded = load_model("demo")
    c = loaded.config
    model = LlamaModel(c, loaded.weights, TorchOps(), torch.device("cpu"), torch.float32)
    pool = KvPool(PoolConfig(pool_tokens=256, page_size=16), c.num_layers, c.num_kv_heads,
                  c.head_dim, torch.float32, torch.device("cpu"))
    layout = KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32)
    engine = PrefillEngine(model, pool, layout, 4096, make_logger("prefill", stream=io.StringIO()),
                           Counters(), SendBudget(64 << 20))
    streams: list[list] = [[], []]
    ended = [threading.Event(), threading.Event()]
    senders = [InlineSender(f"r{i}") if plane == "inline" else
               SharedMemorySender(f"r{i}", layout, len(PROMPTS[i]), str(tmp_path))
               for i in range(2)]

    def emitter(i: int):
        def emit(frame) -> None:
            if frame is None:
                ended[i].set()
                return
            streams[i].append(handoff_pb2.PrefillResponse.FromString(frame))
            if i == 0 and len(streams[0]) == 1:
                senders[0].release(False)  # job 0's stream is gone after its first chunk
        return emit

    for i in range(2):  # both queued before the engine starts: they form one batch
        engine.submit(PrefillJob(f"r{i}", PROMPTS[i], SamplingConfig(), 2, emitter(i),
                                 sender=senders[i]))
    engine.start()
    try:
        assert all(e.wait(60) for e in ended)
        assert streams[1][-1].commit.status == handoff_pb2.HANDOFF_STATUS_OK
        chunks = [f for f in streams[1] if f.WhichOneof("frame") == "chunk"]
        assert len(chunks) == c.num_layers * 2  # 4 tokens in chunks of 2, every layer
        assert [f.WhichOneof("frame") for f in streams[0]][0] == "chunk"
        assert not any(f.WhichOneof("frame") == "commit"
                       and f.commit.status == handoff_pb2.HANDOFF_STATUS_ABORTED
                       for f in streams[0])
        snap = pool.allocator.snapshot()
        assert snap.pages_free == snap.pages_total
    finally:
        engine.stop()
        for sender in senders:
            sender.release(False)
