"""Tiny Hugging Face checkpoints made by the tests themselves (random weights, save_pretrained)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TinySpec:
    name: str
    architecture: str  # "llama" or "qwen2"
    num_heads: int
    num_kv_heads: int
    tied: bool
    head_dim: int = 16
    layers: int = 2
    vocab: int = 320


SPECS = [
    TinySpec("llama-gqa2-untied", "llama", num_heads=4, num_kv_heads=2, tied=False),
    TinySpec("llama-gqa4-tied", "llama", num_heads=8, num_kv_heads=2, tied=True),
    TinySpec("qwen2-gqa2-bias", "qwen2", num_heads=4, num_kv_heads=2, tied=False),
]


def make_checkpoint(spec: TinySpec, root: Path, seed: int = 0):
    """Saves the checkpoint under root/spec.name and returns (path, transformers model)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=spec.vocab, hidden_size=spec.num_heads * spec.head_dim,
        num_hidden_layers=spec.layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, intermediate_size=96,
        max_position_embeddings=256, tie_word_embeddings=spec.tied, rms_norm_eps=1e-6,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, head_dim=spec.head_dim)
    torch.manual_seed(seed)
    if spec.architecture == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=5000.0, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(rope_theta=20000.0, **common))
    model = model.float().eval()
    with torch.no_grad():  # transformers zero-initializes biases; make them matter
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)
    path = root / spec.name
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generation, stopping at eos like the service does."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    new = out[0, len(prompt):].tolist()
    eos = model.config.eos_token_id
    if eos in new:
        new = new[: new.index(eos) + 1]
    return new
