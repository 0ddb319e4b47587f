"""How many tokens a service's pool holds, and the start-up invariant against the window.

A service refuses to start when its pool cannot hold one request at the full context window,
unless the operator says --allow-context-beyond-pool; then the effective prompt limit is the
pool, and that smaller number is what the service reports and enforces everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.config import ServiceConfig
from common.handoff.layout import KvLayout
from common.model.config import ModelConfig


class CapacityError(ValueError):
    """The configuration cannot serve its own context window; the message says what to change."""


@dataclass(frozen=True)
class Capacity:
    page_size: int
    num_pages: int
    kv_bytes_per_token: int
    context_window: int
    sized_by: str
    # the most tokens one forward pass carries; an activation peak set aside (CUDA with
    # --memory-fraction) was measured at this many
    max_pass_tokens: int = 0

    @property
    def pool_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def pool_bytes(self) -> int:
        return self.pool_tokens * self.kv_bytes_per_token

    @property
    def max_prompt_tokens(self) -> int:
        return min(self.context_window, self.pool_tokens)

    def describe(self) -> dict:
        return {"pool_pages": self.num_pages, "pool_tokens": self.pool_tokens,
                "pool_bytes": self.pool_bytes, "kv_bytes_per_token": self.kv_bytes_per_token,
                "page_size": self.page_size, "context_window": self.context_window,
                "max_prompt_tokens": self.max_prompt_tokens, "sized_by": self.sized_by,
                "max_pass_tokens": self.max_pass_tokens}


def _pool_tokens(service: ServiceConfig, per_token: int, device: torch.device,
                 activation_peak_bytes: int, max_pass_tokens: int) -> tuple[int, str]:
    if service.pool_tokens > 0:
        return service.pool_tokens, "pool_tokens"
    if service.memory_fraction > 0:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * service.memory_fraction) - activation_peak_bytes
            return max(budget, 0) // per_token, (
                f"memory_fraction={service.memory_fraction} of {free} free bytes after the "
                f"weights, less a measured activation peak of {activation_peak_bytes} bytes "
                f"(a forward pass of {max_pass_tokens} tokens)")
        if service.kv_cache_bytes <= 0:
            raise CapacityError("--memory-fraction on the CPU needs --kv-cache-bytes as the budget")
        budget = int(service.kv_cache_bytes * service.memory_fraction)
        return budget // per_token, f"memory_fraction={service.memory_fraction} of kv_cache_bytes"
    if service.kv_cache_bytes > 0:
        return service.kv_cache_bytes // per_token, "kv_cache_bytes"
    raise CapacityError("set one of --pool-tokens, --memory-fraction, --kv-cache-bytes")


def plan_capacity(service: ServiceConfig, model: ModelConfig, dtype: torch.dtype,
                  device: torch.device, activation_peak_bytes: int = 0,
                  max_pass_tokens: int = 0) -> Capacity:
    """Sizes the pool (call after the weights are on the device and the activation peak was
    measured) and checks the invariant. activation_peak_bytes is the peak of one forward pass
    of max_pass_tokens tokens: with chunked prefill no pass carries more, whatever the
    prompt length, so that peak holds for every prompt the pool admits."""
    if service.page_size < 1:
        raise CapacityError(f"--page-size must be >= 1, got {service.page_size}")
    window = service.max_context_tokens or model.max_position_embeddings
    if window > model.max_position_embeddings:
        raise CapacityError(f"--max-context-tokens {window} exceeds the model's "
                            f"max_position_embeddings {model.max_position_embeddings}")
    per_token = KvLayout.from_model(model, dtype).kv_bytes_per_token
    tokens, sized_by = _pool_tokens(service, per_token, device, activation_peak_bytes,
                                    max_pass_tokens)
    num_pages = tokens // service.page_size
    if num_pages < 1:
        raise CapacityError(f"the pool holds {tokens} tokens, less than one page of "
                            f"{service.page_size}; give it more memory or tokens")
    capacity = Capacity(service.page_size, num_pages, per_token, window, sized_by,
                        max_pass_tokens)
    if capacity.pool_tokens < window and not service.allow_context_beyond_pool:
        raise CapacityError(
            f"the KV pool holds {capacity.pool_tokens} tokens but the context window is {window} "
            f"tokens: a prompt at the window could not be served. Raise --pool-tokens "
            f"(or --memory-fraction / --kv-cache-bytes), lower --max-context-tokens, or pass "
            f"--allow-context-beyond-pool to serve prompts of at most {capacity.pool_tokens} "
            f"tokens")
    return capacity
