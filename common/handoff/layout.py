"""KV layouts on the wire and their torch dtypes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.pb.kvhandoff.v1 import common_pb2

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 1
# The first minor version whose handoffs are bound to their request (nonce, digest, checksums).
PROTOCOL_MINOR_BOUND = 1
DEFAULT_MAX_CHUNK_BYTES = 4 << 20
TARGET_CHUNK_BYTES = 1 << 20

_DTYPES = {
    torch.float32: common_pb2.KV_DTYPE_FLOAT32,
    torch.float16: common_pb2.KV_DTYPE_FLOAT16,
    torch.bfloat16: common_pb2.KV_DTYPE_BFLOAT16,
}
_TORCH = {v: k for k, v in _DTYPES.items()}


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

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token_per_layer(self) -> int:
        """Bytes of K (or of V alone) for one token in one layer."""
        return self.num_kv_heads * self.head_dim * self.element_size

    def chunk_tokens(self, max_chunk_bytes: int) -> int:
        """Tokens per chunk so that K plus V stay near TARGET_CHUNK_BYTES and within the maximum."""
        budget = min(TARGET_CHUNK_BYTES, max_chunk_bytes or DEFAULT_MAX_CHUNK_BYTES)
        return max(1, budget // (2 * self.bytes_per_token_per_layer))

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
