"""D-63 on the inline plane: a chunk carrying a shared-memory reference is refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.handoff.binding import new_nonce, prompt_digest
from common.handoff.codec import chunk_wire
from common.handoff.reasons import HandoffRefused
from common.handoff.transfer import TransferRecord, TransferState
from common.handoff.verifier import Expectation
from common.pb.kvhandoff.v1 import handoff_pb2
from common.sampling import SamplingConfig
from decode_svc.engine_answer import engine_answer
from decode_svc.handoff import InlineReceiver
from decode_svc.kv_receiver import HandoffJob
from tests.planes.test_shared_memory_refusals import (CHUNK_TOKENS, FINGERPRINT, PROMPT,
                                                      FakeClient, _handoff, _layout)


def test_a_reference_on_an_inline_handoff_is_refused(harness, shm):
    """D-63 on the inline plane: a chunk with its bytes AND a reference (to a region that
    exists and is valid) is refused before anything is read or landed; pages back."""
    baseline = harness.pages_free()
    nonce = new_nonce()
    frames, sender, kv = _handoff(harness, shm, "inline-ref", nonce)
    inline = [frames[0]]  # the same header and commit; the chunks with their bytes inline
    for layer, layer_kv in enumerate(kv):
        for start in range(0, len(PROMPT), CHUNK_TOKENS):
            part = layer_kv[:, start:start + CHUNK_TOKENS].contiguous()
            inline.append(chunk_wire("inline-ref", len(inline) - 1, layer, start, part, nonce))
    inline.append(frames[-1])
    both = handoff_pb2.PrefillResponse.FromString(inline[2])
    both.chunk.ref.CopyFrom(handoff_pb2.PrefillResponse.FromString(frames[2]).chunk.ref)
    inline[2] = both.SerializeToString()

    async def receive():
        await engine_answer(lambda done: harness.engine.reserve("inline-ref", len(PROMPT), done))
        expect = Expectation("inline-ref", len(PROMPT), _layout(harness), FINGERPRINT, 4 << 20,
                             harness.model.config.vocab_size, nonce, prompt_digest(PROMPT))
        request = handoff_pb2.PrefillRequest(request_id="inline-ref", token_ids=PROMPT,
                                             nonce=nonce)
        return await InlineReceiver(client, harness.engine).receive(
            HandoffJob(request, expect, SamplingConfig(), 30.0), record)

    client = FakeClient(inline)
    record = TransferRecord("inline-ref", "inline")
    with pytest.raises(HandoffRefused) as refused:
        asyncio.run(receive())
    assert refused.value.reason == "REFERENCE_UNEXPECTED"
    assert refused.value.code == grpc.StatusCode.INTERNAL
    assert "chunk 1 " in refused.value.message
    assert record.state == TransferState.FAILED and client.call.cancelled
    harness.engine.release("inline-ref")
    harness.drain()
    assert harness.pages_free() == baseline
    sender.release(False)
