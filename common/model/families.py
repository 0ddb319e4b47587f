"""The model families this server runs, the small named pieces in which they differ, and what
is refused at start (with a message that names it).

All supported families are one decoder (common/model/llama.py): RMSNorm, RoPE, grouped-query
attention, SwiGLU. A family says only what differs:

- ``qk_norm``: a per-head RMSNorm over head_dim on q and k before RoPE (Qwen3);
- ``sliding_window``: how the config turns a sliding window on (always refused when it would
  bite: attention here is full causal attention);
- biases are taken from the checkpoint when present (Qwen2's q/k/v, Llama's attention_bias),
  so they need no flag.
"""

from __future__ import annotations

from dataclasses import dataclass


class UnsupportedModelError(ValueError):
    """The checkpoint is not one this server can run; the message says what and why."""


@dataclass(frozen=True)
class Family:
    name: str
    qk_norm: bool = False
    # "mistral": `sliding_window` set means on; "qwen": only with `use_sliding_window` true.
    sliding_window_style: str = "mistral"


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama"),
    "MistralForCausalLM": Family("mistral"),
    "Qwen2ForCausalLM": Family("qwen2", sliding_window_style="qwen"),
    "Qwen3ForCausalLM": Family("qwen3", qk_norm=True, sliding_window_style="qwen"),
}

# Architectures people ask for that are refused by name, with the feature that is missing.
REFUSED_ARCHITECTURES: dict[str, str] = {
    "MixtralForCausalLM": "mixture-of-experts layers",
    "Qwen2MoeForCausalLM": "mixture-of-experts layers",
    "Qwen3MoeForCausalLM": "mixture-of-experts layers",
    "Qwen3NextForCausalLM": "mixture-of-experts layers and linear attention",
    "DeepseekV2ForCausalLM": "multi-head latent attention (MLA) and mixture-of-experts layers",
    "DeepseekV3ForCausalLM": "multi-head latent attention (MLA) and mixture-of-experts layers",
    "MiniCPM3ForCausalLM": "multi-head latent attention (MLA)",
    "Gemma2ForCausalLM": "sliding-window layers and logit soft-capping",
    "Gemma3ForCausalLM": "sliding-window layers",
    "Cohere2ForCausalLM": "sliding-window layers",
    "MinistralForCausalLM": "sliding-window layers",
    "Phi3ForCausalLM": "longrope scaling and a fused qkv projection",
}

# Config keys that betray a feature this decoder does not have, whatever the architecture says.
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
MLA_KEYS = ("kv_lora_rank", "q_lora_rank")


def family_for(raw: dict) -> Family:
    """The family of an HF config.json dict; raises UnsupportedModelError naming what is not
    supported (architecture, MoE, MLA, sliding window, activation)."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    supported = ", ".join(FAMILIES)
    if arch in REFUSED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported: {REFUSED_ARCHITECTURES[arch]} are not "
            f"implemented; supported: {supported}")
    if arch not in FAMILIES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported; supported: {supported}")
    family = FAMILIES[arch]
    moe = [k for k in MOE_KEYS if raw.get(k)]
    if moe:
        raise UnsupportedModelError(
            f"{arch} with mixture-of-experts layers ({', '.join(moe)} set) is not supported")
    mla = [k for k in MLA_KEYS if raw.get(k)]
    if mla:
        raise UnsupportedModelError(
            f"{arch} with multi-head latent attention ({', '.join(mla)} set) is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {raw.get('hidden_act')!r} is not supported "
                                    "(only silu)")
    _refuse_sliding_window(raw, arch, family)
    return family


def _refuse_sliding_window(raw: dict, arch: str, family: Family) -> None:
    layer_types = raw.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        kinds = sorted({t for t in layer_types if t != "full_attention"})
        raise UnsupportedModelError(f"{arch} with layer types {kinds} is not supported: "
                                    "only full attention layers are implemented")
    window = raw.get("sliding_window")
    on = raw.get("use_sliding_window", False) if family.sliding_window_style == "qwen" else (
        window is not None)
    if not on:
        return
    max_positions = int(raw.get("max_position_embeddings", 2048))
    if window is not None and int(window) >= max_positions:
        return  # a window as wide as every position this server serves never masks anything
    raise UnsupportedModelError(
        f"{arch} with sliding-window attention (sliding_window={window}, "
        f"max_position_embeddings={max_positions}) is not supported: this server computes full "
        "causal attention; use a checkpoint whose config has sliding_window null")
