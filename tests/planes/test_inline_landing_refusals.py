"""The inline plane's landing in the pages (decode_svc.inline_landing) through the real
InlineReceiver and engine: an honest handoff lands the prompt's KV exactly and is accepted; a
NaN that prefill checksummed lands, and Verify refuses KV_NOT_FINITE; a payload changed on the
way is refused CHECKSUM_MISMATCH by the verifier; pages back at baseline after each."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common.handoff.binding import new_nonce, prompt_digest
from common.handoff.codec import chunk_wire, commit_frame, frame_wire, header_frame
from common.handoff.reasons import HandoffRefused
from common.handoff.transfer import TransferRecord, TransferState
from common.handoff.verifier import Expectation
from common.pb.kvhandoff.v1 import handoff_pb2
from common.sampling import SamplingConfig
from decode_svc.engine_answer import engine_answer
from decode_svc.handoff import InlineReceiver
from decode_svc.kv_receiver import HandoffJob
from tests.planes.test_shared_memory_refusals import (CHUNK_TOKENS, FINGERPRINT, PROMPT,
                                                      FakeClient, _layout)


def _frames(harness, request_id: str, nonce: bytes, kv: list[torch.Tensor], first: int
            ) -> list[bytes]:
    layout = _layout(harness)
    frames = [frame_wire(header_frame(request_id, len(PROMPT), handoff_pb2.HANDOFF_STATUS_OK,
                                      layout, FINGERPRINT, nonce=nonce,
                                      digest=prompt_digest(PROMPT)))]
    for layer, layer_kv in enumerate(kv):  # [2, n, Hkv, D]
        for start in range(0, len(PROMPT), CHUNK_TOKENS):
            part = layer_kv[:, start:start + CHUNK_TOKENS].contiguous()
            frames.append(chunk_wire(request_id, len(frames) - 1, layer, start, part, nonce))
    frames.append(frame_wire(commit_frame(request_id, len(PROMPT), len(frames) - 1, first,
                                          nonce=nonce)))
    return frames


def _receive(harness, request_id: str, nonce: bytes, frames: list[bytes], in_place: bool):
    record = TransferRecord(request_id, "inline")

    async def run():
        engine = harness.engine
        await engine_answer(lambda done: engine.reserve(request_id, len(PROMPT), done))
        expect = Expectation(request_id, len(PROMPT), _layout(harness), FINGERPRINT, 4 << 20,
                             harness.model.config.vocab_size, nonce, prompt_digest(PROMPT))
        request = handoff_pb2.PrefillRequest(request_id=request_id, token_ids=PROMPT,
                                             nonce=nonce)
        receiver = InlineReceiver(FakeClient(frames), engine, in_place=in_place)
        assert receiver.in_place is in_place
        await receiver.receive(HandoffJob(request, expect, SamplingConfig(), 30.0), record)
        await engine_answer(lambda done: engine.after_writes(lambda: done(None)))
        landed.extend((engine.pool.k.clone(), engine.pool.v.clone()))  # before Verify's checks
        return await engine_answer(lambda done: engine.verify(
            request_id, PROMPT, SamplingConfig(), done))

    landed: list[torch.Tensor] = []
    return asyncio.run(run()), record, landed


@pytest.mark.parametrize("in_place", [True, False])
def test_an_honest_handoff_lands_exactly_the_prompts_kv(harness, in_place):
    baseline = harness.pages_free()
    nonce = new_nonce()
    first, kv, _ = harness.prefill(PROMPT)
    try:
        verdict, record, landed = _receive(harness, "ok", nonce,
                                           _frames(harness, "ok", nonce, kv, first), in_place)
        assert record.state == TransferState.SUCCESS, verdict
        assert not isinstance(verdict, Exception), verdict
        pool = harness.engine.pool
        table = pool.allocator.page_table("ok")
        slots = [table[t // pool.page_size] * pool.page_size + t % pool.page_size
                 for t in range(len(PROMPT))]
        for layer, layer_kv in enumerate(kv):
            for side, cache in enumerate(landed):  # [L, P, S, Hkv, D]
                got = cache[layer].reshape(-1, *cache.shape[3:])[slots]  # [n, Hkv, D]
                assert torch.equal(got.view(torch.uint8), layer_kv[side].view(torch.uint8))
    finally:
        harness.engine.release("ok")
        harness.drain()
    assert harness.pages_free() == baseline


def test_a_checksummed_nan_lands_and_is_refused_at_verify(harness):
    baseline = harness.pages_free()
    nonce = new_nonce()
    first, kv, _ = harness.prefill(PROMPT)
    kv[-1][1, -1, -1, -1] = float("nan")  # the last layer's V, last token
    with pytest.raises(HandoffRefused) as refused:
        try:
            _receive(harness, "nan", nonce, _frames(harness, "nan", nonce, kv, first), True)
        finally:
            harness.engine.release("nan")
            harness.drain()
    assert refused.value.reason == "KV_NOT_FINITE"
    assert harness.pages_free() == baseline


def test_a_payload_changed_on_the_way_is_refused_by_its_checksum(harness):
    baseline = harness.pages_free()
    nonce = new_nonce()
    first, kv, _ = harness.prefill(PROMPT)
    frames = _frames(harness, "bad", nonce, kv, first)
    bad = bytearray(frames[4])
    bad[len(bad) // 2] ^= 0x40  # a payload byte, inside K or V
    frames[4] = bytes(bad)
    with pytest.raises(HandoffRefused) as refused:
        try:
            _receive(harness, "bad", nonce, frames, True)
        finally:
            harness.engine.release("bad")
            harness.drain()
    assert refused.value.reason == "CHECKSUM_MISMATCH"
    assert "chunk 3 " in refused.value.message
    assert harness.pages_free() == baseline
