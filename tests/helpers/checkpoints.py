"""Tiny Hugging Face checkpoints made by the tests themselves (random weights, save_pretrained)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch


@dataclass(frozen=True)
class TinySpec:
    name: str
    architecture: str  # "llama", "qwen2", "mistral" or "qwen3"
    num_heads: int
    num_kv_heads: int
    tied: bool
    head_dim: int = 16
    layers: int = 2
    vocab: int = 320
    hidden: int | None = None  # None: num_heads * head_dim
    max_positions: int = 256
    rope: dict | None = None  # rope_parameters beyond rope_theta (rope_type, factor, ...)
    bos_id: int = 1
    eos_id: int = 2
    tokenizer: str | None = None  # tokenizer files to ship: "llama3", "chatml" or "mistral"


SPECS = [
    TinySpec("llama-gqa2-untied", "llama", num_heads=4, num_kv_heads=2, tied=False),
    TinySpec("llama-gqa4-tied", "llama", num_heads=8, num_kv_heads=2, tied=True),
    TinySpec("qwen2-gqa2-bias", "qwen2", num_heads=4, num_kv_heads=2, tied=False),
]

# Today's families, with rope scaling that bites: original_max_position_embeddings (128) is far
# below the prompts of the long tests (>= 700 tokens).
LONG_POSITIONS = 1024
FAMILY_SPECS = [
    TinySpec("llama31-rope-llama3", "llama", num_heads=4, num_kv_heads=2, tied=False,
             max_positions=LONG_POSITIONS,
             rope={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
             tokenizer="llama3"),
    TinySpec("llama-rope-yarn", "llama", num_heads=4, num_kv_heads=1, tied=True,
             max_positions=LONG_POSITIONS,
             rope={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128},
             tokenizer="llama3"),
    TinySpec("llama-rope-linear", "llama", num_heads=4, num_kv_heads=2, tied=False,
             max_positions=LONG_POSITIONS, rope={"rope_type": "linear", "factor": 4.0},
             tokenizer="llama3"),
    TinySpec("mistral-gqa4-headdim", "mistral", num_heads=8, num_kv_heads=2, tied=False,
             head_dim=8, hidden=48, max_positions=LONG_POSITIONS, tokenizer="mistral"),
    TinySpec("qwen3-qknorm-headdim", "qwen3", num_heads=4, num_kv_heads=2, tied=False,
             head_dim=24, hidden=64, max_positions=LONG_POSITIONS, tokenizer="chatml"),
]

THETA = {"llama": 5000.0, "qwen2": 20000.0, "mistral": 8000.0, "qwen3": 30000.0}


def hf_model_for(spec: TinySpec):
    """A transformers model of the spec with random weights (not yet saved)."""
    import transformers as tf

    classes = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
               "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
               "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}
    config_cls, model_cls = classes[spec.architecture]
    common = {
        "vocab_size": spec.vocab, "hidden_size": spec.hidden or spec.num_heads * spec.head_dim,
        "num_hidden_layers": spec.layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "intermediate_size": 96,
        "max_position_embeddings": spec.max_positions, "tie_word_embeddings": spec.tied,
        "rms_norm_eps": 1e-6, "initializer_range": 0.2, "bos_token_id": spec.bos_id,
        "eos_token_id": spec.eos_id, "head_dim": spec.head_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": THETA[spec.architecture],
                         **(spec.rope or {})}}
    if spec.architecture == "mistral":
        common["sliding_window"] = None
    return model_cls(config_cls(**common))


def make_checkpoint(spec: TinySpec, root: Path, seed: int = 0):
    """Saves the checkpoint under root/spec.name and returns (path, transformers model). With
    spec.tokenizer, the tokenizer files are trained and saved beside the weights and the
    vocabulary is the tokenizer's (at least spec.vocab)."""
    staging = root / f"{spec.name}-tokenizer"
    if spec.tokenizer is not None:
        from tests.helpers.tokenizer_files import write_tokenizer

        spec = replace(spec, vocab=max(spec.vocab, write_tokenizer(staging, spec.tokenizer)))
    torch.manual_seed(seed)
    model = hf_model_for(spec).float().eval()
    with torch.no_grad():  # transformers zero-initializes biases and ones norms; make them matter
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    path = root / spec.name
    model.save_pretrained(path, safe_serialization=True)
    if spec.tokenizer is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (path / name).write_bytes((staging / name).read_bytes())
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


def make_chat_checkpoint(root: Path, seed: int = 0):
    """A Llama-3.1-style checkpoint (llama3 rope scaling) with a trained byte-level tokenizer
    and a chat template; -> (path, transformers model, PreTrainedTokenizerFast)."""
    from transformers import PreTrainedTokenizerFast

    spec = replace(FAMILY_SPECS[0], name="llama31-chat", bos_id=0, eos_id=4)
    path, model = make_checkpoint(spec, root, seed)
    return path, model, PreTrainedTokenizerFast.from_pretrained(str(path))
