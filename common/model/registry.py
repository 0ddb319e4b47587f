"""From architecture name to the model that runs it.

Every supported architecture (common/model/families.py) runs on the one Llama-family decoder,
configured by its family's named pieces; a new decoder class registers here, and the engines
see only the CausalLM protocol.
"""

from __future__ import annotations

import torch

from common.model.config import ModelConfig
from common.model.families import FAMILIES, UnsupportedModelError
from common.model.llama import LlamaModel
from common.model.protocol import CausalLM
from common.ops.interface import KernelOps

MODEL_CLASSES: dict[str, type] = {arch: LlamaModel for arch in FAMILIES}


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor], ops: KernelOps,
                device: torch.device, dtype: torch.dtype) -> CausalLM:
    """The registered model for config.architecture, its weights placed on device."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise UnsupportedModelError(f"no model is registered for {config.architecture!r}")
    check_kernels_fit(config, ops)
    return cls(config, weights, ops, device, dtype)


TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)  # what the attention kernels are built for


def check_kernels_fit(config: ModelConfig, ops: KernelOps) -> None:
    """Refuses at start what the chosen kernels cannot run, rather than at the first request."""
    if ops.name == "triton" and config.head_dim not in TRITON_HEAD_DIMS:
        raise UnsupportedModelError(
            f"head_dim {config.head_dim} is not supported by the Triton attention kernels "
            f"(head_dim must be one of {', '.join(map(str, TRITON_HEAD_DIMS))}); "
            "run with --kernels torch")


def required_weights(config: ModelConfig) -> list[str]:
    """Tensor names a checkpoint of this config must hold (biases are optional)."""
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        required.append("lm_head.weight")
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        required += [f"{p}.self_attn.{n}_proj.weight" for n in ("q", "k", "v", "o")]
        required += [f"{p}.mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        required += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        if config.qk_norm:
            required += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
    return required
