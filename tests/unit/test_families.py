"""The rope tables equal transformers' for every supported rope type, and what the server
cannot run (MoE, MLA, sliding windows, other rope types) is refused at load with its name."""

from __future__ import annotations

import json

import pytest
import torch

from common.model.config import ModelConfig, UnsupportedModelError
from common.model.loader import load_model
from tests.helpers.checkpoints import FAMILY_SPECS, hf_model_for, make_checkpoint

ROPES = [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 128},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
     "original_max_position_embeddings": 512},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
     "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
     "attention_factor": 1.5, "truncate": False},
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r["rope_type"])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_rope_table_equals_transformers(rope, head_dim):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                            max_position_embeddings=1024,
                            rope_parameters={"rope_theta": 50000.0, **rope})
    ours = ModelConfig.from_hf_dict({**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    rotary = LlamaRotaryEmbedding(hf_config)
    positions = torch.arange(1024)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)  # [1, P, D]
    table = ours.rope.table(1024, head_dim, torch.device("cpu"))  # [P, D]
    half = head_dim // 2
    torch.testing.assert_close(table[:, :half], cos[0, :, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(table[:, half:], sin[0, :, :half], rtol=0, atol=1e-6)
    if rope["rope_type"] not in ("default", "dynamic"):  # the scaling really changes the table
        default = {"rope_type": "default", "rope_theta": 50000.0}
        plain = ModelConfig.from_hf_dict({**hf_config.to_dict(), "rope_parameters": default,
                                          "architectures": ["LlamaForCausalLM"]})
        assert plain.rope.theta == ours.rope.theta
        assert not torch.allclose(table, plain.rope.table(1024, head_dim, torch.device("cpu")))


def _raw(arch: str, **extra) -> dict:
    return {"architectures": [arch], "vocab_size": 10, "hidden_size": 8, "head_dim": 4,
            "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16,
            "max_position_embeddings": 4096, **extra}


@pytest.mark.parametrize(("raw", "named"), [
    (_raw("MixtralForCausalLM", num_local_experts=8), "mixture-of-experts"),
    (_raw("Qwen3MoeForCausalLM"), "mixture-of-experts"),
    (_raw("DeepseekV3ForCausalLM"), "MLA"),
    (_raw("LlamaForCausalLM", num_experts=4), "mixture-of-experts"),
    (_raw("LlamaForCausalLM", kv_lora_rank=64), "latent attention"),
    (_raw("MistralForCausalLM", sliding_window=1024), "sliding_window=1024"),
    (_raw("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=512), "sliding-window"),
    (_raw("Qwen3ForCausalLM", layer_types=["sliding_attention"]), "sliding_attention"),
    (_raw("LlamaForCausalLM", rope_scaling={"type": "longrope", "factor": 2.0}), "longrope"),
    (_raw("LlamaForCausalLM", partial_rotary_factor=0.5), "partial_rotary_factor"),
    (_raw("LlamaForCausalLM", hidden_act="gelu"), "gelu"),
])
def test_unsupported_features_are_refused_by_name(raw, named):
    with pytest.raises(UnsupportedModelError, match=named):
        ModelConfig.from_hf_dict(raw)


def test_sliding_window_wider_than_every_position_is_accepted():
    """Mistral configs often carry a window >= max_position_embeddings: it never masks."""
    config = ModelConfig.from_hf_dict(_raw("MistralForCausalLM", sliding_window=4096))
    assert config.family == "mistral"
    qwen = ModelConfig.from_hf_dict(_raw("Qwen2ForCausalLM", sliding_window=512,
                                         use_sliding_window=False))
    assert qwen.family == "qwen2"


@pytest.mark.parametrize("spec", FAMILY_SPECS, ids=lambda s: s.name)
def test_each_family_loads_with_its_pieces(spec, tmp_path):
    path, _ = make_checkpoint(spec, tmp_path)
    loaded = load_model(str(path))
    c = loaded.config
    assert c.qk_norm == (spec.architecture == "qwen3")
    assert c.head_dim == spec.head_dim
    assert c.rope.rope_type == (spec.rope or {}).get("rope_type", "default")


def test_a_qwen3_checkpoint_without_its_qk_norms_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    spec = next(s for s in FAMILY_SPECS if s.architecture == "qwen3")
    path, _ = make_checkpoint(spec, tmp_path)
    weights = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if "q_norm" not in k},
              str(path / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="q_norm"):
        load_model(str(path))


def test_generation_config_eos_ids_join_the_config_ones(tmp_path):
    path, _ = make_checkpoint(FAMILY_SPECS[0], tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert load_model(str(path)).config.eos_token_ids == (2, 7, 9)


def test_hf_model_for_covers_every_family():
    for spec in FAMILY_SPECS:
        assert type(hf_model_for(spec)).__name__.lower().startswith(spec.architecture)


@pytest.mark.parametrize("spec", [FAMILY_SPECS[0], FAMILY_SPECS[-1]], ids=lambda s: s.name)
def test_layer0_kv_is_what_prefill_stores(spec, tmp_path):
    """The protocol's layer0_kv (decode's content check) equals layer 0 of a prefill's KV."""
    from common.model.protocol import PrefillBatch
    from common.model.registry import build_model
    from common.ops.torch_ops import TorchOps

    path, _ = make_checkpoint(spec, tmp_path)
    loaded = load_model(str(path))
    c = loaded.config
    model = build_model(c, loaded.weights, TorchOps(), torch.device("cpu"), torch.float32)
    n = 37
    ids, positions = torch.randint(3, spec.vocab, (n,)), torch.arange(n)
    k_cache = torch.zeros(c.num_layers, 3, 16, c.num_kv_heads, c.head_dim)  # [L, P, S, Hkv, D]
    v_cache = torch.zeros_like(k_cache)
    model.prefill(PrefillBatch(ids, positions, positions, torch.tensor([0, n], dtype=torch.int32),
                               n), k_cache, v_cache)
    k, v = model.layer0_kv(ids, positions)  # [T, Hkv, D]
    torch.testing.assert_close(k, k_cache[0].reshape(-1, c.num_kv_heads, c.head_dim)[:n])
    torch.testing.assert_close(v, v_cache[0].reshape(-1, c.num_kv_heads, c.head_dim)[:n])


def test_triton_kernels_refuse_a_head_dim_they_cannot_run(tmp_path):
    from common.model.registry import build_model
    from common.ops.torch_ops import TorchOps
    from common.ops.triton_ops import TritonOps

    spec = next(s for s in FAMILY_SPECS if s.head_dim == 24)
    path, _ = make_checkpoint(spec, tmp_path)
    loaded = load_model(str(path))
    with pytest.raises(UnsupportedModelError, match="head_dim 24.*--kernels torch"):
        build_model(loaded.config, loaded.weights, TritonOps(), torch.device("cpu"),
                    torch.float32)
    build_model(loaded.config, loaded.weights, TorchOps(), torch.device("cpu"), torch.float32)
