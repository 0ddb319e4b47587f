"""Prefill's running-requests count (StatsService running_requests, the
kvhandoff_running_requests gauge) is the batch being computed: up while its forward pass runs,
back to 0 when it is done."""

from __future__ import annotations

import io
import threading

import torch

from bench.synthetic_prefill import PoolOnlyModel, random_pool
from common.config import PrefillConfig, ServiceConfig
from common.counters import Counters
from common.handoff.layout import KvLayout
from common.log import make_logger
from common.sampling import SamplingConfig
from prefill_svc.engine import PrefillEngine, PrefillJob
from prefill_svc.send_budget import SendBudget
from tests.helpers.polling import wait_until

LAYOUT = KvLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)


class HeldModel(PoolOnlyModel):
    """A forward pass that waits for the test to let it finish."""

    def __init__(self) -> None:
        super().__init__(LAYOUT)
        self.entered, self.release = threading.Event(), threading.Event()

    def prefill(self, batch, k_cache, v_cache, on_layer_stored=None):
        self.entered.set()
        assert self.release.wait(30)
        return super().prefill(batch, k_cache, v_cache, on_layer_stored)


def test_running_count_is_the_batch_in_its_forward_pass():
    model = HeldModel()
    engine = PrefillEngine(model, random_pool(LAYOUT, 64), LAYOUT, 4096,
                           make_logger("prefill", stream=io.StringIO()), Counters(),
                           SendBudget(PrefillConfig(ServiceConfig()).max_unsent_bytes))
    ended = [threading.Event() for _ in range(2)]
    for i in range(2):  # queued before the engine starts: one batch of two
        engine.submit(PrefillJob(f"r{i}", [5, 6, 7], SamplingConfig(), 64,
                                 lambda frame, i=i: frame is None and ended[i].set()))
    assert engine.running_count() == 0
    engine.start()
    try:
        assert model.entered.wait(30)
        assert engine.running_count() == 2 and engine.waiting_count() == 0
        model.release.set()
        assert all(e.wait(30) for e in ended)
        wait_until(lambda: engine.running_count() == 0, 10, "the batch counted out")
    finally:
        model.release.set()
        engine.stop()
