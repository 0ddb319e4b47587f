"""Building handoff frames on prefill and turning verified chunk bytes back into tensors."""

from __future__ import annotations

import google_crc32c
import torch

from common.handoff.layout import KvLayout, protocol_version
from common.pb.kvhandoff.v1 import handoff_pb2


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Little-endian raw bytes of a CPU tensor (bf16 included)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def bytes_to_kv(layout: KvLayout, k: bytes, v: bytes, num_tokens: int) -> torch.Tensor:
    """-> [2, num_tokens, Hkv, D] on the CPU; the bytes were already size-checked."""
    shape = (num_tokens, layout.num_kv_heads, layout.head_dim)
    k_t = torch.frombuffer(bytearray(k), dtype=torch.uint8).view(layout.dtype).view(shape)
    v_t = torch.frombuffer(bytearray(v), dtype=torch.uint8).view(layout.dtype).view(shape)
    return torch.stack([k_t, v_t])


def header_frame(request_id: str, token_count: int, status: int, layout: KvLayout | None,
                 fingerprint: str, reason: str = "", reason_code: str = ""
                 ) -> handoff_pb2.PrefillResponse:
    header = handoff_pb2.HandoffHeader(
        protocol_version=protocol_version(), request_id=request_id, token_count=token_count,
        status=status, reason=reason, reason_code=reason_code, model_fingerprint=fingerprint)
    if layout is not None:
        header.layout.CopyFrom(layout.to_proto())
    return handoff_pb2.PrefillResponse(header=header)


def chunk_frame(request_id: str, sequence_number: int, layer: int, token_start: int,
                kv: torch.Tensor) -> handoff_pb2.PrefillResponse:
    """kv: [2, n, Hkv, D] on the CPU."""
    k, v = tensor_bytes(kv[0]), tensor_bytes(kv[1])
    crc = google_crc32c.extend(google_crc32c.value(k), v)
    chunk = handoff_pb2.KvChunk(
        request_id=request_id, sequence_number=sequence_number, layer=layer,
        token_start=token_start, token_end=token_start + kv.shape[1], k=k, v=v, crc32c=crc)
    return handoff_pb2.PrefillResponse(chunk=chunk)


def commit_frame(request_id: str, token_count: int, chunk_count: int, first_token_id: int,
                 status: int = handoff_pb2.HANDOFF_STATUS_OK, reason: str = ""
                 ) -> handoff_pb2.PrefillResponse:
    return handoff_pb2.PrefillResponse(commit=handoff_pb2.HandoffCommit(
        request_id=request_id, token_count=token_count, chunk_count=chunk_count,
        first_token_id=first_token_id, status=status, reason=reason))
