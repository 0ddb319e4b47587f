"""The fast data plane over real gRPC: prefill's pre-serialized frames read by the generated
stubs and by decode's raw-bytes client give the same handoff, and bytes that are not a frame
are refused as FRAME_MALFORMED."""

from __future__ import annotations

import io

import grpc
import pytest
import torch

from bench.synthetic_prefill import (FINGERPRINT, PAGE_SIZE, VOCAB, PoolOnlyModel, SyntheticSpec,
                                     _capacity, random_pool)
from common.handoff.binding import new_nonce, prompt_digest
from common.config import PrefillConfig, ServiceConfig
from common.counters import Counters
from common.handoff.codec import bytes_to_kv
from common.handoff.layout import KvLayout, protocol_version
from common.handoff.reasons import HandoffRefused
from common.handoff.verifier import Expectation, HandoffVerifier
from common.log import make_logger
from common.pb.kvhandoff.v1 import handoff_pb2, handoff_pb2_grpc
from common.sampling import SamplingConfig
from decode_svc.prefill_client import LARGE_FRAME_BYTES, PREFILL_METHOD, PrefillClient
from prefill_svc.engine import PrefillEngine
from prefill_svc.send_budget import SendBudget
from prefill_svc.servicer import HandoffServicer, add_handoff_service
from prefill_svc.validation import PrefillLimits

LAYOUT = KvLayout(num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
MAX_CHUNK = 64 << 10  # small chunks: several per layer


def _expected(pool, layer: int, start: int, end: int) -> torch.Tensor:
    """Every page holds page 0's random KV, so token t of any request is slot t % page size."""
    slots = torch.arange(start, end) % PAGE_SIZE
    return torch.stack([pool.k[layer, 0, slots], pool.v[layer, 0, slots]])


async def _start_prefill(pool_tokens: int = 1024):
    log = make_logger("prefill", stream=io.StringIO())
    pool = random_pool(LAYOUT, pool_tokens)
    for cache in (pool.k, pool.v):  # same content in every page: any page table reads alike
        cache.copy_(cache[:, :1].expand_as(cache))
    engine = PrefillEngine(PoolOnlyModel(LAYOUT), pool, LAYOUT, pool_tokens, log, Counters(),
                           SendBudget(PrefillConfig(ServiceConfig()).max_unsent_bytes))
    capacity = _capacity(SyntheticSpec(LAYOUT, pool_tokens))
    limits = PrefillLimits(VOCAB, pool_tokens, pool_tokens, FINGERPRINT,
                           LAYOUT.kv_bytes_per_token_per_layer)
    servicer = HandoffServicer(engine, LAYOUT, capacity, limits, Counters(), log)
    server = grpc.aio.server()
    add_handoff_service(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    engine.start()
    return server, engine, pool, f"127.0.0.1:{port}"


def _request(request_id: str, tokens: int, nonce: bytes = b"") -> handoff_pb2.PrefillRequest:
    return handoff_pb2.PrefillRequest(
        request_id=request_id, token_ids=[3] * tokens, protocol_version=protocol_version(),
        nonce=nonce or new_nonce(), model_fingerprint=FINGERPRINT,
        sampling=SamplingConfig().to_proto(), max_chunk_bytes=MAX_CHUNK)


async def test_raw_client_and_generated_stub_read_the_same_handoff():
    server, engine, pool, address = await _start_prefill()
    tokens = 300  # 128 tokens per chunk: 3 chunks per layer, the last one short
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = handoff_pb2_grpc.HandoffServiceStub(channel)
            info = await stub.GetPrefillInfo(handoff_pb2.GetPrefillInfoRequest())
            assert info.model_fingerprint == FINGERPRINT and info.page_size == PAGE_SIZE
            reference = [frame async for frame in stub.Prefill(_request("ref", tokens))]
        client = PrefillClient(address, MAX_CHUNK, None)
        nonce = new_nonce()
        expect = Expectation("fast", tokens, LAYOUT, FINGERPRINT, MAX_CHUNK, VOCAB, nonce,
                             prompt_digest([3] * tokens))
        verifier = HandoffVerifier(expect)
        fast = []
        async for frame in client.prefill(_request("fast", tokens, nonce), timeout=30):
            chunk = verifier.on_frame(frame)
            if chunk is not None:
                n = chunk.token_end - chunk.token_start
                fast.append((chunk.layer, chunk.token_start, chunk.token_end,
                             bytes_to_kv(LAYOUT, chunk.k, chunk.v, n)))
        assert verifier.finish() == 0
        await client.close()
    finally:
        await server.stop(0)
        engine.stop()
    chunks = [f.chunk for f in reference if f.WhichOneof("frame") == "chunk"]
    assert [f.WhichOneof("frame") for f in reference] == ["header", *["chunk"] * 9, "commit"]
    assert len(fast) == len(chunks) == 9
    for (layer, start, end, got), chunk in zip(fast, chunks):
        assert (layer, start, end) == (chunk.layer, chunk.token_start, chunk.token_end)
        assert torch.equal(got, bytes_to_kv(LAYOUT, chunk.k, chunk.v, end - start))
        assert torch.equal(got, _expected(pool, layer, start, end))
    assert pool.allocator.snapshot().pages_free == pool.allocator.num_pages


@pytest.mark.parametrize("size", [7, LARGE_FRAME_BYTES + 5])
async def test_bytes_that_are_no_frame_are_refused_as_malformed(size):
    async def garbage(request, context):
        yield b"\xff" * size  # field 31, wire type 7: not protobuf

    handler = grpc.unary_stream_rpc_method_handler(
        garbage, request_deserializer=handoff_pb2.PrefillRequest.FromString,
        response_serializer=None)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        PREFILL_METHOD.split("/")[1], {"Prefill": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = PrefillClient(f"127.0.0.1:{port}", 1 << 20, None)
    try:
        stream = client.prefill(_request("x", 4), timeout=30)
        with pytest.raises(HandoffRefused) as refused:
            async for _ in stream:
                pass
        stream.cancel()
        assert refused.value.reason == "FRAME_MALFORMED"
        assert refused.value.code == grpc.StatusCode.INTERNAL
    finally:
        await client.close()
        await server.stop(0)
