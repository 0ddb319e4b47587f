"""One Prefill call against a real prefill servicer and engine, in process, on a pool-only model
(bench.synthetic_prefill): the frames it streamed, the RPC error that ended it (None when it
ended cleanly), and every JSON line prefill logged meanwhile."""

from __future__ import annotations

import io
import json

import grpc

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
from prefill_svc.servicer import HandoffServicer, add_handoff_service
from prefill_svc.validation import PrefillLimits

POOL_TOKENS = 64


def prefill_request(request_id: str, token_ids: list[int]) -> handoff_pb2.PrefillRequest:
    """A well-formed request for the servicer `run_prefill` starts."""
    return handoff_pb2.PrefillRequest(request_id=request_id, token_ids=token_ids,
                                      protocol_version=protocol_version(),
                                      nonce=new_nonce(), model_fingerprint=FINGERPRINT)


async def run_prefill(layout: KvLayout, request: handoff_pb2.PrefillRequest, metadata=None
                      ) -> tuple[list[handoff_pb2.PrefillResponse], grpc.aio.AioRpcError | None,
                                 list[dict]]:
    """-> (frames, the error that ended the call or None, prefill's log events)."""
    stream = io.StringIO()
    log = make_logger("prefill", stream=stream)
    engine = PrefillEngine(PoolOnlyModel(layout), random_pool(layout, POOL_TOKENS), layout,
                           POOL_TOKENS, log, Counters(),
                           SendBudget(PrefillConfig(ServiceConfig()).max_unsent_bytes))
    capacity = Capacity(PAGE_SIZE, POOL_TOKENS // PAGE_SIZE, layout.kv_bytes_per_token,
                        POOL_TOKENS, "test")
    limits = PrefillLimits(VOCAB, POOL_TOKENS, POOL_TOKENS, FINGERPRINT,
                           layout.kv_bytes_per_token_per_layer)
    server = grpc.aio.server()
    add_handoff_service(HandoffServicer(engine, layout, capacity, limits, Counters(), log),
                        server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    engine.start()
    frames, error = [], None
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = handoff_pb2_grpc.HandoffServiceStub(channel).Prefill(
                request, timeout=30, metadata=metadata)
            try:
                async for frame in call:
                    frames.append(frame)
            except grpc.aio.AioRpcError as exc:  # a rejection ends the call with its status
                error = exc
    finally:
        await server.stop(0)
        engine.stop()
    return frames, error, [json.loads(line) for line in stream.getvalue().splitlines()
                           if line.strip()]

