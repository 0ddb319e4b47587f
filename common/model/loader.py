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
    ModelNotFoundError (a FileNotFoundError)."""
    if spec == "demo":
        return build_demo_model()
    root = Path(spec)
    config = checkpoint_config(root)
    config_path = root / "config.json"
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{root}: no *.safetensors weights found")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        weights.update(load_file(str(path)))
    _check_weights(config, weights, config_path)
    config = dataclasses.replace(config, eos_token_ids=_eos_ids(root, config.eos_token_ids))
    tokenizer = HfTokenizer.from_dir(root) if (root / "tokenizer.json").is_file() else None
    if tokenizer is not None:
        _check_tokenizer(config, tokenizer, root)
    return LoadedModel(config, weights, tokenizer, fingerprint_checkpoint(root), str(root))


class ModelNotFoundError(FileNotFoundError):
    """--model names no checkpoint directory; the message names the path and what to pass."""


def checkpoint_config(root: Path) -> ModelConfig:
    """The validated config.json of a checkpoint directory, read without its weights (so `up`
    can refuse a bad --model before it starts anything); raises ModelNotFoundError or
    UnsupportedModelError naming the path."""
    config_path = root / "config.json"
    if not root.exists():
        raise ModelNotFoundError(f"--model {root}: no such directory; pass --model demo or a "
                                f"Hugging Face checkpoint directory (config.json, "
                                f"*.safetensors)")
    if not root.is_dir():
        raise ModelNotFoundError(f"--model {root}: a file, not a directory; pass the checkpoint "
                                f"directory that holds config.json (or --model demo)")
    if not config_path.is_file():
        raise ModelNotFoundError(
            f"--model {root}: no config.json in it; pass --model demo or a checkpoint directory")
    return ModelConfig.from_hf_dict(_read_json(config_path), source=str(config_path))


def _read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UnsupportedModelError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise UnsupportedModelError(f"{path}: not a JSON object")
    return raw


def _check_weights(config: ModelConfig, weights: dict[str, torch.Tensor],
                   config_path: Path) -> None:
    from common.model.registry import required_weights

    missing = [name for name in required_weights(config) if name not in weights]
    if missing:
        raise UnsupportedModelError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights and weights[name].shape[0] != config.vocab_size:
            raise UnsupportedModelError(
                f"{config_path}: vocab_size {config.vocab_size} disagrees with the weights: "
                f"{name} has {weights[name].shape[0]} rows; fix vocab_size")


def _check_tokenizer(config: ModelConfig, tokenizer: HfTokenizer, root: Path) -> None:
    """Every id the tokenizer can produce needs a row of the embedding (fewer ids than
    vocab_size is common: embeddings are padded)."""
    top = max(tokenizer.inner.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= config.vocab_size:
        raise UnsupportedModelError(
            f"{root / 'tokenizer.json'} has ids up to {top} but config.json's vocab_size is "
            f"{config.vocab_size}: ids from {config.vocab_size} on have no embedding; use the "
            f"tokenizer that came with the checkpoint")


def _eos_ids(root: Path, from_config: tuple[int, ...]) -> tuple[int, ...]:
    """config.json's eos ids, then generation_config.json's (what transformers' generate stops
    at; instruct checkpoints list their end-of-turn id there)."""
    path = root / "generation_config.json"
    raw = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    extra = raw if isinstance(raw, list) else ([] if raw is None else [raw])
    return tuple(dict.fromkeys([*from_config, *(int(t) for t in extra)]))
