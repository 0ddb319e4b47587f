"""Loads a Hugging Face checkpoint directory: config.json, *.safetensors, tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from common.model.config import ModelConfig, UnsupportedModelError
from common.model.demo import build_demo_model
from common.model.fingerprint import fingerprint_checkpoint
from common.model.loaded import LoadedModel
from common.tokenizer import HfTokenizer


def load_model(spec: str) -> LoadedModel:
    """spec is 'demo' or a checkpoint directory; raises UnsupportedModelError or
    FileNotFoundError."""
    if spec == "demo":
        return build_demo_model()
    root = Path(spec)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{root}: no config.json; pass --model demo or a checkpoint directory")
    config = ModelConfig.from_hf_dict(json.loads(config_path.read_text()))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{root}: no *.safetensors weights found")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        weights.update(load_file(str(path)))
    _check_weights(config, weights)
    tokenizer_path = root / "tokenizer.json"
    tokenizer = HfTokenizer.from_file(tokenizer_path) if tokenizer_path.is_file() else None
    return LoadedModel(config, weights, tokenizer, fingerprint_checkpoint(root), str(root))


def _check_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        required.append("lm_head.weight")
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        required += [f"{p}.self_attn.{n}_proj.weight" for n in ("q", "k", "v", "o")]
        required += [f"{p}.mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        required += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
    missing = [name for name in required if name not in weights]
    if missing:
        raise UnsupportedModelError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
