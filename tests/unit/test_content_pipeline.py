"""The content checks run layer by layer as the KV lands (decode_svc.content_pipeline) judge a
handoff exactly as the checks run after the commit (decode_svc.content_check): the same layer-0
error, the same per-layer depth errors and logits for the same positions, the same refusals;
the pages hold exactly what arrived between stages; a pipeline that did not see every layer
leaves the judgement to the checks in full."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from common.counters import Counters
from common.handoff.reasons import HandoffRefused
from common.kvpool.kv_cache import KvPool, PoolConfig
from common.model.demo import build_demo_model
from common.model.protocol import PrefillBatch
from common.model.registry import build_model
from common.ops.select import make_ops
from common.sampling import SamplingConfig
from decode_svc.content_check import ContentCheckConfig, _depth_error, check_content
from decode_svc.content_pipeline import ContentPipeline

PAGE = 16
N = 45  # three pages, the last one partly used


@dataclass(frozen=True)
class Chunk:
    layer: int
    token_start: int
    token_end: int


class InlineEngine:
    """The engine's after_writes, run at once (its queue order: the writes came first)."""

    def __init__(self, model, pool, borrowing_at: int | None = None) -> None:
        self.model, self.pool = model, pool
        self.queued = 0
        self.borrowing_at = borrowing_at  # the stage from which prefill borrows decode's CPUs
        self.counters = Counters()

    def after_writes(self, then) -> None:
        self.queued += 1
        then()

    def peer_borrowing(self) -> bool:
        return self.borrowing_at is not None and self.queued > self.borrowing_at


@pytest.fixture(scope="module")
def model():
    loaded = build_demo_model()
    return build_model(loaded.config, loaded.weights, make_ops("cpu", torch.device("cpu")),
                       torch.device("cpu"), torch.float32)


def _landed(model, ids: list[int]) -> KvPool:
    c = model.config
    pool = KvPool(PoolConfig(pool_tokens=8 * PAGE, page_size=PAGE), c.num_layers,
                  c.num_kv_heads, c.head_dim, torch.float32, torch.device("cpu"))
    pages = pool.allocator.allocate("r", len(ids))
    slots = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(len(ids))])
    batch = PrefillBatch(token_ids=torch.tensor(ids), positions=torch.arange(len(ids)),
                         slot_mapping=slots,
                         cu_seqlens=torch.tensor([0, len(ids)], dtype=torch.int32),
                         max_seqlen=len(ids))
    model.prefill(batch, pool.k, pool.v)
    return pool


def _chunks(num_layers: int, shuffled: bool) -> list[Chunk]:
    chunks = [Chunk(layer, start, min(start + 16, N)) for layer in range(num_layers)
              for start in range(0, N, 16)]
    if shuffled:
        random.Random(3).shuffle(chunks)
    return chunks


def _ids(model) -> list[int]:
    return [(5 * i + 7) % (model.config.vocab_size - 3) + 3 for i in range(N)]


@pytest.mark.parametrize("shuffled", [False, True])
def test_same_verdict_as_the_checks_after_the_commit(model, shuffled):
    ids = _ids(model)
    pool = _landed(model, ids)
    engine = InlineEngine(model, pool)
    before = (pool.k.clone(), pool.v.clone())
    pipeline = ContentPipeline(engine, "r", ids, 4, random.Random(1))
    for chunk in _chunks(model.config.num_layers, shuffled):
        pipeline.on_chunk(chunk)
    assert pipeline.complete and engine.queued == model.config.num_layers
    assert torch.equal(pool.k, before[0]) and torch.equal(pool.v, before[1])  # as arrived
    sampling = SamplingConfig()
    verdict = check_content(model, pool, "r", ids, sampling, ContentCheckConfig(),
                            random.Random(0), prepared=pipeline)
    assert verdict.positions == tuple(pipeline.positions) and verdict.landed_seconds > 0

    pages = pool.allocator.page_table("r")
    table = torch.tensor(pages, dtype=torch.int32)
    depth, _, logits = _depth_error(model, pool, pages, table, torch.tensor(ids),
                                    list(pipeline.positions))
    assert torch.equal(logits, pipeline.logits)
    assert depth == verdict.depth_error
    full = check_content(model, _landed(model, ids), "r", ids, sampling, ContentCheckConfig(),
                         random.Random(0))
    assert full.first_token_id == verdict.first_token_id
    assert full.layer0_error == verdict.layer0_error and full.landed_seconds == 0


@pytest.mark.parametrize("layer, reason", [(0, "KV_LAYER0_MISMATCH"),
                                           (2, "KV_DEPTH_MISMATCH")])
def test_a_wrong_layer_is_refused_as_after_the_commit(model, layer, reason):
    ids = _ids(model)
    pool = _landed(model, ids)
    pages = pool.allocator.page_table("r")
    last = pages[(N - 1) // PAGE] * PAGE + (N - 1) % PAGE  # the last position: always drawn
    pool.k[layer].flatten(0, 1)[last] *= -1
    pipeline = ContentPipeline(InlineEngine(model, pool), "r", ids, 2)
    for chunk in _chunks(model.config.num_layers, False):
        pipeline.on_chunk(chunk)
    with pytest.raises(HandoffRefused) as refused:
        check_content(model, pool, "r", ids, SamplingConfig(), ContentCheckConfig(),
                      random.Random(0), prepared=pipeline)
    assert refused.value.reason == reason


def test_a_pipeline_short_of_a_layer_leaves_it_to_the_full_checks(model):
    ids = _ids(model)
    pool = _landed(model, ids)
    engine = InlineEngine(model, pool)
    pipeline = ContentPipeline(engine, "r", ids, 4)
    for chunk in _chunks(model.config.num_layers, False)[:-1]:  # the last layer's end missing
        pipeline.on_chunk(chunk)
    assert not pipeline.complete and engine.queued == model.config.num_layers - 1
    verdict = check_content(model, pool, "r", ids, SamplingConfig(), ContentCheckConfig(),
                            random.Random(0), prepared=pipeline)
    assert verdict.landed_seconds == 0  # judged by the checks in full


@pytest.mark.parametrize("borrowing_at", [0, 3])
def test_stages_leave_the_cpus_to_a_borrowed_prefill_pass(model, borrowing_at):
    """While prefill computes on decode's CPUs no stage runs; the checks in full judge it, with
    the same first token, and the pages hold what arrived."""
    ids = _ids(model)
    pool = _landed(model, ids)
    before = (pool.k.clone(), pool.v.clone())
    pipeline = ContentPipeline(InlineEngine(model, pool, borrowing_at), "r", ids, 4)
    for chunk in _chunks(model.config.num_layers, False):
        pipeline.on_chunk(chunk)
    assert pipeline.deferred and not pipeline.complete and pipeline.cursor == borrowing_at
    assert pipeline.engine.counters.get("content_checks_deferred") == 1
    assert torch.equal(pool.k, before[0]) and torch.equal(pool.v, before[1])
    verdict = check_content(model, pool, "r", ids, SamplingConfig(), ContentCheckConfig(),
                            random.Random(0), prepared=pipeline)
    full = check_content(model, _landed(model, ids), "r", ids, SamplingConfig(),
                         ContentCheckConfig(), random.Random(0))
    assert verdict.landed_seconds == 0 and verdict.first_token_id == full.first_token_id


def test_a_released_request_stops_the_stages(model):
    ids = _ids(model)
    pool = _landed(model, ids)
    pipeline = ContentPipeline(InlineEngine(model, pool), "r", ids, 4)
    pool.release("r")
    for chunk in _chunks(model.config.num_layers, False):
        pipeline.on_chunk(chunk)
    assert pipeline.failed and not pipeline.complete and pipeline.cursor == 0


def test_a_stage_that_fails_leaves_the_pages_as_they_arrived(model, monkeypatch):
    import decode_svc.content_check as content_check

    ids = _ids(model)
    pool = _landed(model, ids)
    before = (pool.k.clone(), pool.v.clone())
    real, calls = content_check._depth_compare, []

    def fails_at_layer_1(sent, mine):
        calls.append(1)
        if len(calls) == 2:  # after layer 1's rows were stored into the pages
            raise RuntimeError("stage failed")
        return real(sent, mine)
    monkeypatch.setattr(content_check, "_depth_compare", fails_at_layer_1)

    class LoggingEngine(InlineEngine):  # as the engine's after_writes: a failure is logged
        def after_writes(self, then) -> None:
            try:
                super().after_writes(then)
            except RuntimeError:
                pass
    pipeline = ContentPipeline(LoggingEngine(model, pool), "r", ids, 4, random.Random(1))
    for chunk in _chunks(model.config.num_layers, False):
        pipeline.on_chunk(chunk)
    assert pipeline.failed and not pipeline.complete and len(calls) == 2
    assert torch.equal(pool.k, before[0]) and torch.equal(pool.v, before[1])  # as arrived
