"""A generating request inside the decode engine, and the events it sends its client stream."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from common.errors import ServiceError
from common.sampling import SamplingConfig


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    index: int


@dataclass(frozen=True)
class FinishedEvent:
    reason: str  # "stop" or "length"
    completion_tokens: int


@dataclass(frozen=True)
class FailedEvent:
    error: ServiceError


Event = TokenEvent | FinishedEvent | FailedEvent


@dataclass
class Sequence:
    """tokens holds prompt then generated ids; every token but the last has its KV in pages."""

    request_id: str
    prompt_len: int
    tokens: list[int]
    max_tokens: int
    sampling: SamplingConfig
    stop_ids: frozenset[int]
    emit: Callable[[Event], None]
    pages: list[int] = field(default_factory=list)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def finish_reason(self) -> str | None:
        if self.tokens[-1] in self.stop_ids:
            return "stop"
        if self.num_generated >= self.max_tokens:
            return "length"
        return None
