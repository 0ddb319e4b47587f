"""The engine's landing of received K/V bytes (WriteBytes) fails closed like the tensor path."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from common.errors import ServiceError
from common.handoff.reasons import HandoffRefused
from common.sampling import SamplingConfig
from decode_svc.engine_answer import engine_answer

PROMPT = list(range(3, 20))


def _bytes(t: torch.Tensor) -> np.ndarray:
    return np.frombuffer(t.contiguous().view(torch.uint8).numpy().tobytes(), np.uint8)


def _verify(harness, request_id: str, payload) -> object:
    """Reserves, lands payload(layer) for every layer through write_bytes, then verifies."""
    engine = harness.engine
    c = harness.model.config

    async def run():
        await engine_answer(lambda done: engine.reserve(request_id, len(PROMPT), done))
        for layer in range(c.num_layers):
            k, v = payload(layer)
            engine.write_bytes(request_id, layer, 0, len(PROMPT), k, v)
        return await engine_answer(lambda done: engine.verify(
            request_id, PROMPT, SamplingConfig(), done))

    try:
        return asyncio.run(run())
    except (ServiceError, HandoffRefused) as err:
        return err
    finally:
        engine.release(request_id)
        harness.drain()


def _kv(harness, fill: float) -> torch.Tensor:
    c = harness.model.config
    return torch.full((len(PROMPT), c.num_kv_heads, c.head_dim), fill, dtype=harness.model.dtype)


@pytest.mark.parametrize("case", ["short payload", "nan"])
def test_a_bad_landing_fails_the_request_and_frees_its_pages(harness, case):
    baseline = harness.pages_free()
    if case == "short payload":  # the landing itself raises (sizes are the verifier's job)
        result = _verify(harness, "short", lambda layer: (_bytes(_kv(harness, 0.5))[:-2],
                                                         _bytes(_kv(harness, 0.5))))
        assert isinstance(result, ServiceError) and result.reason == "KV_WRITE_FAILED"
        assert [e["request_id"] for e in harness.log.events("kv_write_failed")] == [
            "short"] * harness.model.config.num_layers
    else:  # a NaN in the last layer's V, found on the bytes as they land
        bad = _kv(harness, 0.5)
        bad[-1, -1, -1] = float("nan")
        last = harness.model.config.num_layers - 1
        result = _verify(harness, "nan", lambda layer: (
            _bytes(_kv(harness, 0.5)), _bytes(bad if layer == last else _kv(harness, 0.5))))
        assert isinstance(result, HandoffRefused) and result.reason == "KV_NOT_FINITE", result
    assert harness.pages_free() == baseline


@pytest.mark.parametrize("forget", [True, False])
def test_a_retry_into_the_same_pages_is_judged_on_its_own_writes(harness, forget):
    """A failed attempt landed a NaN (last layer) and a write that failed (layer 0); the retry
    lands the prompt's honest KV into the same reservation. After new_attempt the verdict is the
    retry's own (accepted); without it the failed attempt's record would refuse the retry."""
    baseline = harness.pages_free()
    engine, layers = harness.engine, harness.model.config.num_layers
    _, honest, _ = harness.prefill(PROMPT)
    bad = _kv(harness, 0.5)
    bad[-1, -1, -1] = float("nan")

    async def run():
        await engine_answer(lambda done: engine.reserve("r", len(PROMPT), done))
        engine.write_bytes("r", 0, 0, len(PROMPT), _bytes(bad)[:-2], _bytes(bad))
        engine.write_bytes("r", layers - 1, 0, len(PROMPT), _bytes(bad), _bytes(bad))
        if forget:
            await engine_answer(lambda done: engine.new_attempt("r", done))
        for layer in range(layers):
            engine.write_bytes("r", layer, 0, len(PROMPT), _bytes(honest[layer][0]),
                               _bytes(honest[layer][1]))
        return await engine_answer(lambda done: engine.verify(
            "r", PROMPT, SamplingConfig(), done))

    try:
        result = asyncio.run(run())
    except (ServiceError, HandoffRefused) as err:
        result = err
    finally:
        engine.release("r")
        harness.drain()
    if forget:
        assert not isinstance(result, (ServiceError, HandoffRefused)), result
    else:
        assert isinstance(result, ServiceError) and result.reason == "KV_WRITE_FAILED", result
    assert harness.pages_free() == baseline
