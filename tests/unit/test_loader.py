"""The checkpoint loader accepts the supported families and refuses everything else clearly."""

from __future__ import annotations

import json

import pytest

from common.model.config import ModelConfig, UnsupportedModelError
from common.model.loader import load_model
from tests.helpers.checkpoints import SPECS, make_checkpoint


def test_loads_a_llama_checkpoint_and_its_fingerprint_is_stable(tmp_path):
    path, _ = make_checkpoint(SPECS[0], tmp_path)
    first, second = load_model(str(path)), load_model(str(path))
    assert first.config.architecture == "LlamaForCausalLM"
    assert first.config.rope_theta == 5000.0
    assert first.fingerprint == second.fingerprint
    assert first.tokenizer is None


def test_different_weights_have_different_fingerprints(tmp_path):
    a, _ = make_checkpoint(SPECS[0], tmp_path / "a", seed=1)
    b, _ = make_checkpoint(SPECS[0], tmp_path / "b", seed=2)
    assert load_model(str(a)).fingerprint != load_model(str(b)).fingerprint


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "GPT2LMHeadModel", None])
def test_other_architectures_are_refused(arch):
    raw = {"architectures": [arch] if arch else [], "vocab_size": 10, "hidden_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16}
    with pytest.raises(UnsupportedModelError, match="not supported"):
        ModelConfig.from_hf_dict(raw)


def test_unsupported_rope_scaling_is_refused(tmp_path):
    path, _ = make_checkpoint(SPECS[0], tmp_path)
    raw = json.loads((path / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="longrope"):
        load_model(str(path))


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path / "nope"))
