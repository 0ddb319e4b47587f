"""The built-in demo model: a small Llama-shaped decoder with deterministic random weights and a
character tokenizer, made locally (nothing downloaded). Its output is fluent-looking noise."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from common.model.config import ModelConfig
from common.model.fingerprint import fingerprint_weights
from common.tokenizer import CharTokenizer

if TYPE_CHECKING:
    from common.model.loader import LoadedModel

DEMO_SEED = 20260101


def demo_hf_config(vocab_size: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }


def _demo_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(DEMO_SEED)

    def rand(*shape: int, std: float = 0.12) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    w = {"model.embed_tokens.weight": rand(config.vocab_size, h, std=1.0),
         "model.norm.weight": torch.ones(h), "lm_head.weight": rand(config.vocab_size, h, std=0.5)}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        w[f"{p}.self_attn.q_proj.weight"] = rand(config.num_heads * d, h)
        w[f"{p}.self_attn.k_proj.weight"] = rand(config.num_kv_heads * d, h)
        w[f"{p}.self_attn.v_proj.weight"] = rand(config.num_kv_heads * d, h)
        w[f"{p}.self_attn.o_proj.weight"] = rand(h, config.num_heads * d)
        w[f"{p}.mlp.gate_proj.weight"] = rand(i, h)
        w[f"{p}.mlp.up_proj.weight"] = rand(i, h)
        w[f"{p}.mlp.down_proj.weight"] = rand(h, i)
        w[f"{p}.input_layernorm.weight"] = torch.ones(h)
        w[f"{p}.post_attention_layernorm.weight"] = torch.ones(h)
    return w


def build_demo_model() -> LoadedModel:
    from common.model.loader import LoadedModel

    tokenizer = CharTokenizer()
    raw = demo_hf_config(tokenizer.vocab_size)
    config = ModelConfig.from_hf_dict(raw)
    weights = _demo_weights(config)
    return LoadedModel(config, weights, tokenizer, fingerprint_weights(raw, weights), "demo")
