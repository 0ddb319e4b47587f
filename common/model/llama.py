"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3): RMSNorm, RoPE (with scaling),
grouped-query attention, SwiGLU; implements common.model.protocol.CausalLM.

Weights use Hugging Face names. Optional biases (Qwen2's q/k/v, Llama's attention_bias) are
used when present in the checkpoint; Qwen3's per-head q_norm/k_norm when the family has qk_norm.
head_dim may differ from hidden_size / num_heads. All KV goes through the paged pool via the
ops interface.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from common.model.config import ModelConfig
from common.model.cpu_weights import ALL_ROWS, column_major, lm_head_for, packed_linear, packed_rows
from common.model.protocol import DecodeBatch, PrefillBatch
from common.ops.interface import KernelOps

__all__ = ["DecodeBatch", "LlamaModel", "PrefillBatch"]


def _is_projection(name: str) -> bool:
    """The 2-D weights of `_linear`: q/k/v/o and gate/up/down."""
    return name.endswith("_proj.weight")


def _own_pages(batch: PrefillBatch, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill batch -> (page_table [B, W] int32, seq_lens [B] int32): each sequence's pages
    in token order and its tokens in them once this pass stored its KV. A chunk batch has its
    table; a whole prompt's pages are read off slot_mapping at each page's first token (token
    t of a prompt sits at slot pages[t // S] * S + t % S)."""
    lens = batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]  # [B]
    if batch.page_table is not None:
        return batch.page_table, (batch.context_lens + lens).to(torch.int32)
    starts = batch.cu_seqlens[:-1].long()  # [B]
    width = -(-batch.max_seqlen // page_size)
    firsts = starts[:, None] + torch.arange(width, device=starts.device)[None, :] * page_size
    firsts = torch.minimum(firsts, (starts + lens.long() - 1)[:, None])  # [B, W], in the prompt
    table = torch.div(batch.slot_mapping[firsts], page_size, rounding_mode="floor")
    return table.to(torch.int32), lens.to(torch.int32)


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
        if device.type == "cpu":  # storage order only (common/model/cpu_weights.py)
            for name in [n for n in self.w if _is_projection(n)]:
                self.w[name] = column_major(self.w[name])
        # name -> (oneDNN linear, the row counts it serves) (cpu_weights.py)
        self._packed: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], range]] = {}
        if ops.name == "cpu":
            for name in [n for n in self.w if _is_projection(n)]:
                linear = packed_linear(self.w[name], self.w.get(name[:-len("weight")] + "bias"))
                if linear is None:
                    continue
                rows = packed_rows(self.w[name])
                self._packed[name[:-len(".weight")]] = (linear, rows)
                if rows is ALL_ROWS:  # it serves every row count: the only copy
                    del self.w[name]
        tied = "lm_head.weight" not in self.w  # then the embedding table is the head
        head = self.w["model.embed_tokens.weight"] if tied else self.w.pop("lm_head.weight")
        self._lm_head = lm_head_for(head, tied)  # [T, H] -> [T, vocab]
        self.scale = config.head_dim ** -0.5
        self.cos_sin = config.rope.table(config.max_position_embeddings, config.head_dim,
                                         device)  # [P, D]

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        # x: [T, K] -> [T, N]
        packed = self._packed.get(name)
        if packed is not None and x.shape[0] in packed[1]:
            return packed[0](x)
        return F.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def _qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor):
        c = self.config
        p = f"model.layers.{layer}.self_attn"
        q = self._linear(x, f"{p}.q_proj").view(-1, c.num_heads, c.head_dim)  # [T, Hq, D]
        k = self._linear(x, f"{p}.k_proj").view(-1, c.num_kv_heads, c.head_dim)  # [T, Hkv, D]
        v = self._linear(x, f"{p}.v_proj").view(-1, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = self._head_norm(q, f"{p}.q_norm.weight")
            k = self._head_norm(k, f"{p}.k_norm.weight")
        self.ops.rope(q, k, positions, self.cos_sin)
        return q, k, v

    def _head_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        # x: [T, H, D], normed over D per head
        normed, _ = self.ops.rmsnorm(x.reshape(-1, x.shape[-1]), self.w[name],
                                     self.config.rms_norm_eps, None)
        return normed.view(x.shape)

    def _mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{layer}.mlp"
        gate = self._linear(x, f"{p}.gate_proj")
        up = self._linear(x, f"{p}.up_proj")
        return self._linear(F.silu(gate) * up, f"{p}.down_proj")

    def _layer(self, layer: int, x, residual, attend: Callable,
               keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """keep: [B] rows of the T tokens whose output is wanted (None: all); the layer's KV
        still covers every token, and attend(layer, h, keep) computes attention for those rows
        only."""
        p = f"model.layers.{layer}"
        eps = self.config.rms_norm_eps
        if residual is None:  # first layer: the embeddings are the residual stream
            h, _ = self.ops.rmsnorm(x, self.w[f"{p}.input_layernorm.weight"], eps, None)
            residual = x
        else:
            h, residual = self.ops.rmsnorm(
                x, self.w[f"{p}.input_layernorm.weight"], eps, residual)
        if keep is None:
            attn = attend(layer, h)  # [T, Hq * D]
        else:  # row-wise from here on: the other rows' outputs go unread
            attn, residual = attend(layer, h, keep), residual[keep]  # [B, Hq * D], [B, H]
        attn = self._linear(attn, f"{p}.self_attn.o_proj")
        h, residual = self.ops.rmsnorm(
            attn, self.w[f"{p}.post_attention_layernorm.weight"], eps, residual)
        return self._mlp(layer, h), residual

    def _logits(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h, _ = self.ops.rmsnorm(x, self.w["model.norm.weight"], self.config.rms_norm_eps, residual)
        return self._lm_head(h).float()

    @torch.inference_mode()
    def prefill(
        self, batch: PrefillBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
        on_layer_stored: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Runs prompts, storing each layer's KV to batch.slot_mapping in the caches
        [L, P, S, Hkv, D]; calls on_layer_stored(layer) once that layer's KV is in place.
        With batch.page_table (a chunk batch) each chunk attends over its sequence's pages
        (the context before it, then itself, just stored); else over its own K/V.
        Returns the float32 logits of each sequence's last token of the batch: [B, vocab]."""
        if (batch.page_table is None) != (batch.context_lens is None):
            raise ValueError("PrefillBatch: page_table and context_lens come together")

        def attend(layer: int, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
            q, k, v = self._qkv(layer, h, batch.positions)
            self.ops.store_kv(k, v, k_cache[layer], v_cache[layer], batch.slot_mapping)
            if on_layer_stored is not None:
                on_layer_stored(layer)
            if rows is not None and batch.kv_stored:  # only these rows' outputs are read: one
                # query each, over the sequence's pages (all stored by now), as decode reads
                table, lens = _own_pages(batch, k_cache.shape[2])
                out = self.ops.decode_attention(q[rows], k_cache[layer], v_cache[layer], table,
                                                lens, self.scale)  # [B, Hq, D]
            elif batch.page_table is None:
                out = self.ops.prefill_attention(q, k, v, batch.cu_seqlens, batch.max_seqlen,
                                                 self.scale)
            else:
                out = self.ops.paged_prefill_attention(
                    q, k_cache[layer], v_cache[layer], batch.page_table, batch.cu_seqlens,
                    batch.context_lens, batch.max_seqlen, self.scale)
            if rows is not None and not batch.kv_stored:
                out = out[rows]  # [B, Hq, D]
            return out.reshape(out.shape[0], -1)

        x = F.embedding(batch.token_ids, self.w["model.embed_tokens.weight"])  # [T, H]
        residual = None
        last = batch.cu_seqlens[1:].long() - 1  # [B]: each sequence's last token
        final = self.config.num_layers - 1
        for layer in range(self.config.num_layers):
            # past the last layer's KV only the logits' rows are read: its o_proj and MLP
            # run for those B rows, not all T
            x, residual = self._layer(layer, x, residual, attend,
                                      keep=last if layer == final else None)
        return self._logits(x, residual)  # x, residual: [B, H]

    @torch.inference_mode()
    def layer0_kv(self, token_ids: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids, positions: [T] -> layer 0's (K, V), each [T, Hkv, D], exactly as prefill
        stores them; no cache is touched."""
        x = F.embedding(token_ids, self.w["model.embed_tokens.weight"])  # [T, H]
        h, _ = self.ops.rmsnorm(x, self.w["model.layers.0.input_layernorm.weight"],
                                self.config.rms_norm_eps, None)
        _, k, v = self._qkv(0, h, positions)
        return k, v

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
