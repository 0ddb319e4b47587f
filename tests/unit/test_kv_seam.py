"""The seam between the decode servicer and the data planes: typed engine commands, the
transfer state machine, and a servicer that serves through any KvReceiver (here a fake plane)
with output identical to --local-prefill's."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.counters import Counters
from common.handoff.layout import KvLayout
from common.handoff.reasons import refuse
from common.handoff.transfer import TransferRecord, TransferState, TransferStateError
from common.kvpool.kv_cache import PoolConfig
from common.metrics import NullMetrics
from common.pb.kvhandoff.v1 import generate_pb2
from common.sampling import SamplingConfig
from decode_svc.engine import DecodeEngine
from decode_svc.engine_commands import LocalPrefill, Release
from decode_svc.local_prefill import LocalPrefillEngine, LocalPrefillReceiver
from decode_svc.servicer import DecodeState, GenerationServicer
from decode_svc.validation import DecodeLimits
from tests.helpers.fake_transport import FakeKvReceiver
from tests.isolation.inproc import Harness, RecordingLog, make_pool, tiny_model

PROMPT = [5, 9, 17, 33, 2, 64, 8, 11, 40, 3]


def test_transfer_states_only_move_forward():
    record = TransferRecord("r", "inline")
    assert record.state == TransferState.WAITING and not record.done
    record.move(TransferState.TRANSFERRING)
    record.move(TransferState.TRANSFERRING)  # more chunks: still transferring
    record.move(TransferState.SUCCESS)
    assert record.done
    for later in TransferState:
        with pytest.raises(TransferStateError):
            record.move(later)
    failed = TransferRecord("r2", "shared-memory")
    failed.move(TransferState.FAILED, "CHECKSUM_MISMATCH")
    assert failed.failure == "CHECKSUM_MISMATCH"
    with pytest.raises(TransferStateError):
        failed.move(TransferState.TRANSFERRING)


def test_engine_refuses_untyped_and_unknown_commands_in_the_callers_thread():
    model = tiny_model()
    pool = make_pool(model, PoolConfig(pool_tokens=64, page_size=16))
    engine = DecodeEngine(model, pool, 4, 4, RecordingLog(), Counters())
    with pytest.raises(TypeError):
        engine.submit(("release", "r"))  # the old tuple form is gone
    with pytest.raises(TypeError):  # only a LocalPrefillEngine handles LocalPrefill
        engine.submit(LocalPrefill("r", [1], SamplingConfig(), lambda _: None))
    engine.submit(Release("r"))  # a known command is queued
    local = LocalPrefillEngine(model, pool, 4, 4, RecordingLog(), Counters())
    local.submit(LocalPrefill("r", [1], SamplingConfig(), lambda _: None))


class _Log(RecordingLog):
    def bind(self, **fields):
        return self


class _Context:
    def time_remaining(self):
        return None

    async def abort_with_status(self, status):
        raise grpc.aio.AbortError(f"{status.code.name}: {status.details}")


def _servicer(engine: DecodeEngine, receiver, model) -> GenerationServicer:
    c = model.config
    layout = KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, model.dtype)
    state = DecodeState(limits=DecodeLimits(c.vocab_size, 256, 512, 256, 16))
    return GenerationServicer(engine, None, state, layout, "fp", None, (), 4 << 20, 30.0,
                              Counters(), NullMetrics(), _Log(), receiver=receiver)


async def _generate(servicer: GenerationServicer) -> list[int]:
    request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=PROMPT),
                                           max_tokens=6, ignore_eos=True)
    out = []
    async for response in servicer.Generate(request, _Context()):
        if response.HasField("token"):
            out.append(response.token.token_id)
    return out


def _pages_free(harness: Harness) -> int:
    return harness.pages_free()[0]


def test_servicer_serves_through_a_fake_plane_exactly_as_local_prefill():
    harness = Harness(PoolConfig(pool_tokens=256, page_size=16))
    try:
        baseline = _pages_free(harness)
        fake = FakeKvReceiver(harness.engine, lambda ids: harness.prefill(ids)[:2])
        via_fake = asyncio.run(_generate(_servicer(harness.engine, fake, harness.model)))
        assert [r.state for r in fake.records] == [TransferState.SUCCESS]
        assert _pages_free(harness) == baseline
    finally:
        harness.close()
    model = tiny_model()
    pool = make_pool(model, PoolConfig(pool_tokens=256, page_size=16))
    local = LocalPrefillEngine(model, pool, 16, 16, RecordingLog(), Counters())
    local.start()
    try:
        via_local = asyncio.run(_generate(_servicer(local, LocalPrefillReceiver(local), model)))
    finally:
        local.stop()
    assert len(via_fake) == 6 and via_fake == via_local


def test_a_plane_that_fails_mid_transfer_is_refused_and_the_pages_come_back():
    harness = Harness(PoolConfig(pool_tokens=256, page_size=16))
    try:
        baseline = _pages_free(harness)
        fake = FakeKvReceiver(harness.engine, lambda ids: harness.prefill(ids)[:2],
                              fail=refuse("PEER_UNAVAILABLE", "peer died"), fail_after_layers=1)
        with pytest.raises(grpc.aio.AbortError, match="UNAVAILABLE"):
            asyncio.run(_generate(_servicer(harness.engine, fake, harness.model)))
        assert fake.records[0].state == TransferState.FAILED
        assert fake.records[0].failure == "PEER_UNAVAILABLE"
        assert _pages_free(harness) == baseline
    finally:
        harness.close()
