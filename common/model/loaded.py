"""What a service gets from its model source, whichever it is (a checkpoint directory or the
built-in demo): config, weights, tokenizer, fingerprint."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.model.config import ModelConfig
from common.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadedModel:
    """Everything a service needs about its model; weights stay on the CPU until placed."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    fingerprint: str
    source: str
