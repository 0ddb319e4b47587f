"""The fake prefill counts a cancellation however its call ends: also when the cancel lands while
gRPC is writing one of its frames (the handler then never sees CancelledError; the generator is
closed at its yield). This is what made `cancel_after_refusal` flaky under load."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.pb.kvhandoff.v1 import common_pb2, handoff_pb2
from conformance.fake_prefill import FakePrefill
from conformance.handoff_edit import Frame
from conformance.wire import PREFILL_METHOD

pytestmark = pytest.mark.slow

FRAMES = 64
FRAME_BYTES = 1 << 20  # far more than the HTTP/2 window: the fake blocks in a write


def _flood(i) -> list:
    big = Frame()
    big.CopyFrom(i.ref.original[1])
    big.chunk.k = bytes(FRAME_BYTES)
    return [i.ref.original[0], *([big] * FRAMES)]


async def test_cancel_during_a_write_is_counted(reference_prefill):
    fake = FakePrefill(reference_prefill.address)
    port = await fake.start("127.0.0.1:0")
    try:
        fake.script = _flood
        request = handoff_pb2.PrefillRequest(
            request_id="conf-fake-cancel", token_ids=[5, 6, 7], nonce=bytes(range(16)),
            protocol_version=common_pb2.ProtocolVersion(major=1, minor=1),
            model_fingerprint=fake.info.model_fingerprint)
        async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}",
                options=[("grpc.max_receive_message_length", -1)]) as channel:
            call = channel.unary_stream(
                PREFILL_METHOD, request_serializer=handoff_pb2.PrefillRequest.SerializeToString,
                response_deserializer=handoff_pb2.PrefillResponse.FromString)(request, timeout=60)
            received = 0
            async for _ in call:
                received += 1
                if received == 2:  # the fake is writing the next frames now
                    call.cancel()
                    break
            [exchange] = fake.exchanges
            await asyncio.wait_for(exchange.done.wait(), 10)
        assert exchange.cancelled, "a cancel during a write was not counted"
        assert exchange.cancelled_at is not None
        assert len(exchange.sent) < FRAMES + 1, "the fake wrote every frame: nothing cancelled"
    finally:
        await fake.stop()
