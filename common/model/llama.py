"""A Llama-family decoder (Llama, Qwen2): RMSNorm, RoPE, grouped-query attention, SwiGLU.

Weights use Hugging Face names. Optional biases (Qwen2's q/k/v, Llama's attention_bias) are
used when present in the checkpoint. All KV goes through the paged pool via the ops interface.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.kernels.rope import build_cos_sin
from common.model.config import ModelConfig
from common.ops.interface import KernelOps


@dataclass(frozen=True)
class PrefillBatch:
    """A ragged batch of prompts. token_ids, positions, slot_mapping: [T]; cu_seqlens: [B + 1]."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int


@dataclass(frozen=True)
class DecodeBatch:
    """One new token per sequence. token_ids, positions, slot_mapping, seq_lens: [B] (seq_lens
    counts the new token); page_table: [B, max_pages] int32."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor


class LlamaModel:
    """Stateless over requests: every forward reads and writes KV only through the given caches."""

    def __init__(
        self, config: ModelConfig, weights: dict[str, torch.Tensor], ops: KernelOps,
        device: torch.device, dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.ops = ops
        self.device = device
        self.dtype = dtype
        self.w = {name: t.to(device=device, dtype=dtype) for name, t in weights.items()}
        if "lm_head.weight" not in self.w:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        self.scale = config.head_dim ** -0.5
        self.cos_sin = build_cos_sin(config.max_position_embeddings, config.head_dim,
                                     config.rope_theta, device)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def _qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor):
        c = self.config
        p = f"model.layers.{layer}.self_attn"
        q = self._linear(x, f"{p}.q_proj").view(-1, c.num_heads, c.head_dim)  # [T, Hq, D]
        k = self._linear(x, f"{p}.k_proj").view(-1, c.num_kv_heads, c.head_dim)  # [T, Hkv, D]
        v = self._linear(x, f"{p}.v_proj").view(-1, c.num_kv_heads, c.head_dim)
        self.ops.rope(q, k, positions, self.cos_sin)
        return q, k, v

    def _mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{layer}.mlp"
        gate = self._linear(x, f"{p}.gate_proj")
        up = self._linear(x, f"{p}.up_proj")
        return self._linear(F.silu(gate) * up, f"{p}.down_proj")

    def _layer(self, layer: int, x, residual,
               attend: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        p = f"model.layers.{layer}"
        eps = self.config.rms_norm_eps
        if residual is None:  # first layer: the embeddings are the residual stream
            h, _ = self.ops.rmsnorm(x, self.w[f"{p}.input_layernorm.weight"], eps, None)
            residual = x
        else:
            h, residual = self.ops.rmsnorm(
                x, self.w[f"{p}.input_layernorm.weight"], eps, residual)
        attn = attend(layer, h)  # [T, Hq * D]
        attn = self._linear(attn, f"{p}.self_attn.o_proj")
        h, residual = self.ops.rmsnorm(
            attn, self.w[f"{p}.post_attention_layernorm.weight"], eps, residual)
        return self._mlp(layer, h), residual

    def _logits(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h, _ = self.ops.rmsnorm(x, self.w["model.norm.weight"], self.config.rms_norm_eps, residual)
        return F.linear(h, self.w["lm_head.weight"]).float()

    @torch.inference_mode()
    def prefill(
        self, batch: PrefillBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
        on_layer_stored: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Runs prompts, storing each layer's KV to batch.slot_mapping in the caches
        [L, P, S, Hkv, D]; calls on_layer_stored(layer) once that layer's KV is in place.
        Returns the float32 logits of each prompt's last token: [B, vocab]."""

        def attend(layer: int, h: torch.Tensor) -> torch.Tensor:
            q, k, v = self._qkv(layer, h, batch.positions)
            self.ops.store_kv(k, v, k_cache[layer], v_cache[layer], batch.slot_mapping)
            if on_layer_stored is not None:
                on_layer_stored(layer)
            out = self.ops.prefill_attention(q, k, v, batch.cu_seqlens, batch.max_seqlen,
                                             self.scale)
            return out.reshape(out.shape[0], -1)

        x = F.embedding(batch.token_ids, self.w["model.embed_tokens.weight"])  # [T, H]
        residual = None
        for layer in range(self.config.num_layers):
            x, residual = self._layer(layer, x, residual, attend)
        last = batch.cu_seqlens[1:].long() - 1
        return self._logits(x[last], residual[last])

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch, k_cache: torch.Tensor,
               v_cache: torch.Tensor) -> torch.Tensor:
        """One step for every sequence; returns float32 logits [B, vocab]."""

        def attend(layer: int, h: torch.Tensor) -> torch.Tensor:
            q, k, v = self._qkv(layer, h, batch.positions)
            self.ops.store_kv(k, v, k_cache[layer], v_cache[layer], batch.slot_mapping)
            out = self.ops.decode_attention(
                q, k_cache[layer], v_cache[layer], batch.page_table, batch.seq_lens, self.scale)
            return out.reshape(out.shape[0], -1)

        x = F.embedding(batch.token_ids, self.w["model.embed_tokens.weight"])
        residual = None
        for layer in range(self.config.num_layers):
            x, residual = self._layer(layer, x, residual, attend)
        return self._logits(x, residual)

    @torch.inference_mode()
    def layer0_kv(self, token_ids: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer 0's K (after RoPE) and V of tokens at positions, both [T] int64: they depend
        only on each token and its position, so decode can check received KV against them
        without attention. -> k, v: [T, Hkv, D]."""
        x = F.embedding(token_ids, self.w["model.embed_tokens.weight"])  # [T, H]
        h, _ = self.ops.rmsnorm(x, self.w["model.layers.0.input_layernorm.weight"],
                                self.config.rms_norm_eps, None)
        _, k, v = self._qkv(0, h, positions)
        return k, v
