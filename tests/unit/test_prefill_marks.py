"""Prefill's `prefill_streamed` line carries where the request's time went on prefill
(`marks_ago_ms`: ms from each milestone to the line), in the order they happen, so
bench/ttft_trace.py can place them beside decode's timeline."""

from __future__ import annotations

import io
import json

import grpc
import torch

from bench.synthetic_prefill import FINGERPRINT, PAGE_SIZE, VOCAB, PoolOnlyModel, random_pool
from common.capacity import Capacity
from common.config import PrefillConfig, ServiceConfig
from common.counters import Counters
from common.handoff.binding import new_nonce
from common.handoff.layout import KvLayout, protocol_version
from common.log import make_logger
from common.pb.kvhandoff.v1 import handoff_pb2, handoff_pb2_grpc
from prefill_svc.engine import PrefillEngine
from prefill_svc.send_budget import SendBudget
from prefill_svc.servicer import HandoffServicer, add_handoff_service, marks_ago_ms
from prefill_svc.validation import PrefillLimits

LAYOUT = KvLayout(num_layers=3, num_kv_heads=1, head_dim=4, dtype=torch.float32)
POOL_TOKENS = 64
ORDER = ["received", "admitted", "first_chunk_emitted", "last_chunk_emitted", "commit_emitted"]


def test_marks_ago_ms_lists_the_earliest_first_with_its_distance_to_now():
    ago = marks_ago_ms({"b": 10.0, "a": 5.0, "c": 10.5})
    assert list(ago) == ["a", "b", "c"]
    assert ago["a"] - ago["b"] == 5000.0 and ago["b"] - ago["c"] == 500.0
    assert ago["c"] >= 0


async def test_the_streamed_line_carries_the_request_s_marks_in_order():
    stream = io.StringIO()
    log = make_logger("prefill", stream=stream)
    engine = PrefillEngine(PoolOnlyModel(LAYOUT), random_pool(LAYOUT, POOL_TOKENS), LAYOUT,
                           POOL_TOKENS, log, Counters(),
                           SendBudget(PrefillConfig(ServiceConfig()).max_unsent_bytes))
    capacity = Capacity(PAGE_SIZE, POOL_TOKENS // PAGE_SIZE, LAYOUT.kv_bytes_per_token,
                        POOL_TOKENS, "test")
    limits = PrefillLimits(VOCAB, POOL_TOKENS, POOL_TOKENS, FINGERPRINT,
                           LAYOUT.kv_bytes_per_token_per_layer)
    server = grpc.aio.server()
    add_handoff_service(HandoffServicer(engine, LAYOUT, capacity, limits, Counters(), log),
                        server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    engine.start()
    request = handoff_pb2.PrefillRequest(request_id="r-1", token_ids=[3, 4, 5, 6],
                                         protocol_version=protocol_version(),
                                         nonce=new_nonce(), model_fingerprint=FINGERPRINT)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            frames = [f async for f in handoff_pb2_grpc.HandoffServiceStub(channel).Prefill(
                request, timeout=30)]
    finally:
        await server.stop(0)
        engine.stop()
    assert frames[-1].commit.status == handoff_pb2.HANDOFF_STATUS_OK
    events = [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]
    streamed = [e for e in events if e["event"] == "prefill_streamed"]
    assert len(streamed) == 1, events
    marks = streamed[0]["marks_ago_ms"]
    assert list(marks) == ORDER, marks
    ago = [marks[name] for name in ORDER]
    assert ago == sorted(ago, reverse=True) and ago[-1] >= 0, marks
