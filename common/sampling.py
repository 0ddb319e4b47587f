"""Token sampling. Token i of a request is drawn from its logits with a generator seeded by
(seed, i), so the same seed gives the same tokens whichever service or batch draws them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.pb.kvhandoff.v1 import common_pb2

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @classmethod
    def from_proto(cls, p: common_pb2.SamplingParams, fallback_seed: int) -> SamplingConfig:
        return cls(temperature=p.temperature, top_p=p.top_p if p.top_p > 0 else 1.0,
                   top_k=p.top_k, seed=p.seed if p.has_seed else fallback_seed)

    def to_proto(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(temperature=self.temperature, top_p=self.top_p,
                                         top_k=self.top_k, seed=self.seed, has_seed=True)


def step_seed(seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for token `index` of a request (splitmix64)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def sample_one(logits: torch.Tensor, config: SamplingConfig, index: int) -> int:
    """logits: [vocab] float32 (any device) -> token id."""
    if config.is_greedy:
        return int(torch.argmax(logits).item())
    scaled = logits.float().cpu() / config.temperature
    if config.top_k > 0 and config.top_k < scaled.numel():
        kth = torch.topk(scaled, config.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if config.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs[before >= config.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    gen = torch.Generator().manual_seed(step_seed(config.seed, index))
    noise = torch.empty_like(probs).exponential_(generator=gen)  # race of exponentials
    return int(torch.argmax(probs / noise).item())


def sample_batch(logits: torch.Tensor, configs: list[SamplingConfig],
                 indices: list[int]) -> list[int]:
    """logits: [B, vocab] -> one token per row; greedy rows share one argmax."""
    greedy = torch.argmax(logits, dim=-1).tolist()
    return [greedy[row] if cfg.is_greedy else sample_one(logits[row], cfg, idx)
            for row, (cfg, idx) in enumerate(zip(configs, indices))]
