"""Loads a Hugging Face checkpoint directory: config.json, *.safetensors, generation_config.json
(end-of-sequence ids), tokenizer.json and tokenizer_config.json."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from common.model.config import ModelConfig, UnsupportedModelError
from common.model.demo import build_demo_model
from common.model.fingerprint import fingerprint_checkpoint
from common.model.loaded import LoadedModel
from common.text.hf_tokenizer import HfTokenizer


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
    config = dataclasses.replace(config, eos_token_ids=_eos_ids(root, config.eos_token_ids))
    tokenizer = HfTokenizer.from_dir(root) if (root / "tokenizer.json").is_file() else None
    return LoadedModel(config, weights, tokenizer, fingerprint_checkpoint(root), str(root))


def _check_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    from common.model.registry import required_weights

    missing = [name for name in required_weights(config) if name not in weights]
    if missing:
        raise UnsupportedModelError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _eos_ids(root: Path, from_config: tuple[int, ...]) -> tuple[int, ...]:
    """config.json's eos ids, then generation_config.json's (what transformers' generate stops
    at; instruct checkpoints list their end-of-turn id there)."""
    path = root / "generation_config.json"
    raw = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    extra = raw if isinstance(raw, list) else ([] if raw is None else [raw])
    return tuple(dict.fromkeys([*from_config, *(int(t) for t in extra)]))
