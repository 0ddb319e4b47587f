"""common/server/runtime.warm_up: one prefill and one decode step on pages of its own (so the
first request compiles nothing), and the pool back at its baseline afterwards."""

from __future__ import annotations

import io

import pytest

from common.config import ServiceConfig
from common.log import make_logger
from common.server.runtime import build_service_runtime, warm_up


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
def test_warm_up_runs_a_prefill_and_a_decode_step_and_returns_its_pages(kernels):
    config = ServiceConfig(model="demo", kernels=kernels, pool_tokens=4096)
    runtime = build_service_runtime(config, make_logger("decode", stream=io.StringIO()))
    calls = []
    model = runtime.model
    for name in ("prefill", "decode"):
        forward = getattr(model, name)

        def counted(*args, _forward=forward, _name=name, **kwargs):
            calls.append(_name)
            logits = _forward(*args, **kwargs)
            assert logits.shape == (1, model.config.vocab_size) and logits.isfinite().all()
            return logits
        setattr(model, name, counted)
    baseline = runtime.pool.allocator.snapshot()
    warm_up(runtime)
    assert calls == ["prefill", "decode"]
    assert runtime.pool.allocator.snapshot() == baseline
    assert not runtime.pool.allocator.holds("__warmup__")
    runtime.pool.allocator.check_invariants()
