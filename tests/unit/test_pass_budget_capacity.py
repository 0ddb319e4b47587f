"""Capacity planning sizes the activation set-aside by one forward pass of the pass budget
(--max-batch-tokens), which chunked prefill makes a bound for any prompt length, not by a fixed
profile or the prompt."""

from __future__ import annotations

import io
import json

import torch

from common.capacity import plan_capacity
from common.config import ServiceConfig
from common.log import make_logger
from common.model.config import ModelConfig
from common.model.demo import demo_hf_config
from common.server.runtime import PROFILE_TOKENS, build_runtime, profile_tokens

MODEL = ModelConfig.from_hf_dict(demo_hf_config(98))


def test_the_profile_is_the_pass_budget_within_the_window():
    assert profile_tokens(512, 4096) == 512
    assert profile_tokens(1 << 20, 4096) == 4096  # never a pass longer than the window
    assert profile_tokens(0, 1 << 20) == PROFILE_TOKENS  # decode: no pass budget of its own


def test_plan_capacity_reports_the_pass_it_planned_for():
    capacity = plan_capacity(ServiceConfig(pool_tokens=4096, max_context_tokens=2048), MODEL,
                             torch.float32, torch.device("cpu"), 0, 256)
    assert capacity.max_pass_tokens == 256
    assert capacity.describe()["max_pass_tokens"] == 256


def test_build_runtime_plans_for_the_given_pass_budget():
    out = io.StringIO()
    config = ServiceConfig(model="demo", device="cpu", pool_tokens=4096, max_context_tokens=4096,
                           kernels="torch")
    runtime = build_runtime(config, make_logger("prefill", stream=out), max_pass_tokens=300)
    assert runtime.capacity.max_pass_tokens == 300
    ready = [json.loads(line) for line in out.getvalue().splitlines()
             if "runtime_ready" in line]
    assert ready and ready[0]["max_pass_tokens"] == 300
