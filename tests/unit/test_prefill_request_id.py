"""Prefill's log lines of a request carry the x-request-id decode sent, so they join decode's
lines even when the PrefillRequest itself names no request id (MISSING_REQUEST_ID)."""

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
from common.log import REQUEST_ID_METADATA, make_logger
from common.pb.kvhandoff.v1 import handoff_pb2, handoff_pb2_grpc
from prefill_svc.engine import PrefillEngine
from prefill_svc.send_budget import SendBudget
from prefill_svc.servicer import HandoffServicer, add_handoff_service
from prefill_svc.validation import PrefillLimits

LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
POOL_TOKENS = 64


async def _prefill_log_events(request: handoff_pb2.PrefillRequest, metadata) -> list[dict]:
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
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = handoff_pb2_grpc.HandoffServiceStub(channel).Prefill(
                request, timeout=30, metadata=metadata)
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError:
                pass  # a rejection ends the call with its status
    finally:
        await server.stop(0)
        engine.stop()
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def _request(request_id: str) -> handoff_pb2.PrefillRequest:
    return handoff_pb2.PrefillRequest(request_id=request_id, token_ids=[3, 4, 5],
                                      protocol_version=protocol_version(),
                                      nonce=new_nonce(), model_fingerprint=FINGERPRINT)


async def test_a_rejection_without_request_id_is_logged_under_decodes_x_request_id():
    events = await _prefill_log_events(_request(""), ((REQUEST_ID_METADATA, "decode-id-1"),))
    rejected = [e for e in events if e["event"] == "prefill_rejected"]
    assert [e["reason"] for e in rejected] == ["MISSING_REQUEST_ID"]
    assert rejected[0]["request_id"] == "decode-id-1"


async def test_without_metadata_the_prefill_request_id_is_logged():
    events = await _prefill_log_events(_request("r-7"), None)
    phases = {e["event"]: e for e in events if e.get("request_id") == "r-7"}
    assert {"prefill_started", "prefill_streamed"} <= set(phases), events
