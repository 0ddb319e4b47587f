"""KV layouts on the wire and their torch dtypes, and the one definition of how many bytes KV
takes: per token and layer for K alone (a chunk's `k` or `v` field), K plus V (the smallest
chunk payload), and K plus V over all layers (what a pool holds per token)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from common.pb.kvhandoff.v1 import common_pb2

if TYPE_CHECKING:
    from common.model.config import ModelConfig

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 2
# The first minor version whose handoffs are bound to their request (nonce, digest, checksums).
PROTOCOL_MINOR_BOUND = 1
# The first minor version whose commits report the prompt tokens served from the prefix cache
# (HandoffCommit.cached_tokens, SPEC.md D-90): prefill sets it only for a request naming this.
PROTOCOL_MINOR_CACHED = 2
DEFAULT_MAX_CHUNK_BYTES = 4 << 20
TARGET_CHUNK_BYTES = 4 << 20

_DTYPES = {
    torch.float32: common_pb2.KV_DTYPE_FLOAT32,
    torch.float16: common_pb2.KV_DTYPE_FLOAT16,
    torch.bfloat16: common_pb2.KV_DTYPE_BFLOAT16,
}
_TORCH = {v: k for k, v in _DTYPES.items()}
# bytes of one element of each wire dtype (SPEC.md, KvLayout)
DTYPE_BYTES = {
    common_pb2.KV_DTYPE_FLOAT32: 4,
    common_pb2.KV_DTYPE_FLOAT16: 2,
    common_pb2.KV_DTYPE_BFLOAT16: 2,
}


def k_bytes_per_token_per_layer(layout: common_pb2.KvLayout) -> int:
    """Bytes of K for one token in one layer of a wire layout (V is the same size): a chunk's
    `k` and `v` are each (token_end - token_start) times this. 0 for an unknown dtype."""
    return layout.num_kv_heads * layout.head_dim * DTYPE_BYTES.get(layout.dtype, 0)


def kv_bytes_per_token_per_layer(layout: common_pb2.KvLayout) -> int:
    """Bytes of K plus V for one token in one layer: the smallest chunk payload, and the least
    max_chunk_bytes a prefill accepts (CHUNK_LIMIT_TOO_SMALL below it)."""
    return 2 * k_bytes_per_token_per_layer(layout)


def wire_dtype(dtype: torch.dtype) -> int:
    return _DTYPES[dtype]


def torch_dtype(wire: int) -> torch.dtype:
    return _TORCH[wire]


@dataclass(frozen=True)
class KvLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_model(cls, model: ModelConfig, dtype: torch.dtype) -> KvLayout:
        return cls(model.num_layers, model.num_kv_heads, model.head_dim, dtype)

    @cached_property
    def k_bytes_per_token_per_layer(self) -> int:
        """Bytes of K (V is the same size) for one token in one layer."""
        return k_bytes_per_token_per_layer(self.to_proto())

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """Bytes of K plus V for one token in one layer (the smallest chunk payload)."""
        return 2 * self.k_bytes_per_token_per_layer

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K plus V for one token over all layers (what the pool holds per token)."""
        return self.num_layers * self.kv_bytes_per_token_per_layer

    def chunk_tokens(self, max_chunk_bytes: int) -> int:
        """Tokens per chunk so that K plus V stay near TARGET_CHUNK_BYTES and within the maximum."""
        budget = min(TARGET_CHUNK_BYTES, max_chunk_bytes or DEFAULT_MAX_CHUNK_BYTES)
        return max(1, budget // self.kv_bytes_per_token_per_layer)

    def to_proto(self) -> common_pb2.KvLayout:
        return common_pb2.KvLayout(
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, dtype=wire_dtype(self.dtype))

    def matches(self, proto: common_pb2.KvLayout) -> bool:
        return self.to_proto() == proto


def protocol_version() -> common_pb2.ProtocolVersion:
    return common_pb2.ProtocolVersion(major=PROTOCOL_MAJOR, minor=PROTOCOL_MINOR)


def describe_layout(layout: common_pb2.KvLayout) -> str:
    """A wire layout as people read it in refusal messages and logs."""
    return (f"(layers={layout.num_layers}, kv_heads={layout.num_kv_heads}, "
            f"head_dim={layout.head_dim}, dtype={layout.dtype})")
