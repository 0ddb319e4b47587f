"""Pool sizing and the start-up invariant against the context window."""

from __future__ import annotations

import pytest
import torch

from common.capacity import CapacityError, plan_capacity
from common.config import ServiceConfig
from common.handoff.layout import KvLayout
from common.model.demo import demo_hf_config
from common.model.config import ModelConfig

MODEL = ModelConfig.from_hf_dict(demo_hf_config(98))
CPU = torch.device("cpu")


def kv_bytes_per_token(dtype: torch.dtype) -> int:
    return KvLayout.from_model(MODEL, dtype).kv_bytes_per_token


def test_kv_sizes_say_what_they_count():
    layout = KvLayout.from_model(MODEL, torch.float32)  # 4 layers, 2 kv heads, head dim 64
    assert layout.k_bytes_per_token_per_layer == 2 * 64 * 4  # K alone, one layer
    assert layout.kv_bytes_per_token_per_layer == 2 * 2 * 64 * 4  # K and V, one layer
    assert layout.kv_bytes_per_token == 2 * 4 * 2 * 64 * 4  # K and V, every layer
    assert kv_bytes_per_token(torch.bfloat16) == 2 * 4 * 2 * 64 * 2


def test_the_pool_is_sized_by_k_and_v_of_every_layer():
    config = ServiceConfig(pool_tokens=0, kv_cache_bytes=2 * 4 * 2 * 64 * 4 * 100, page_size=1,
                           allow_context_beyond_pool=True)
    assert plan_capacity(config, MODEL, torch.float32, CPU).pool_tokens == 100


def test_pool_smaller_than_window_refuses_to_start_with_a_useful_message():
    config = ServiceConfig(pool_tokens=1000, max_context_tokens=4096, page_size=16)
    with pytest.raises(CapacityError) as info:
        plan_capacity(config, MODEL, torch.float32, CPU)
    text = str(info.value)
    assert "992" in text and "4096" in text  # the pool rounded to pages, and the window
    assert "--allow-context-beyond-pool" in text and "--pool-tokens" in text


def test_override_makes_the_pool_the_prompt_limit():
    config = ServiceConfig(pool_tokens=1000, max_context_tokens=4096, page_size=16,
                           allow_context_beyond_pool=True)
    capacity = plan_capacity(config, MODEL, torch.float32, CPU)
    assert capacity.pool_tokens == 992
    assert capacity.max_prompt_tokens == 992
    assert capacity.context_window == 4096


def test_pool_sized_from_a_byte_budget_on_the_cpu():
    per_token = kv_bytes_per_token(torch.float32)
    config = ServiceConfig(pool_tokens=0, kv_cache_bytes=per_token * 8192, page_size=16)
    capacity = plan_capacity(config, MODEL, torch.float32, CPU)
    assert capacity.pool_tokens == 8192
    assert capacity.pool_bytes == per_token * 8192
    half = ServiceConfig(pool_tokens=0, kv_cache_bytes=per_token * 16384, memory_fraction=0.5)
    assert plan_capacity(half, MODEL, torch.float32, CPU).pool_tokens == 8192


def test_memory_fraction_on_cpu_needs_a_budget():
    with pytest.raises(CapacityError, match="kv-cache-bytes"):
        plan_capacity(ServiceConfig(pool_tokens=0, memory_fraction=0.5), MODEL, torch.float32, CPU)


def test_window_beyond_the_model_is_refused():
    with pytest.raises(CapacityError, match="max_position_embeddings"):
        plan_capacity(ServiceConfig(max_context_tokens=10_000), MODEL, torch.float32, CPU)


@pytest.mark.gpu
def test_memory_fraction_sizes_from_free_device_memory():
    device = torch.device("cuda")
    free, _ = torch.cuda.mem_get_info(device)
    config = ServiceConfig(pool_tokens=0, memory_fraction=0.1)
    capacity = plan_capacity(config, MODEL, torch.bfloat16, device)
    expected = int(free * 0.1) // kv_bytes_per_token(torch.bfloat16) // 16 * 16
    assert abs(capacity.pool_tokens - expected) <= 0.02 * expected
