"""The model's shape, read from a Hugging Face config.json (or built for the demo model)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.model.families import FAMILIES, UnsupportedModelError, family_for
from common.model.rope_scaling import RopeConfigError, RopeScaling

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "UnsupportedModelError"]


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    family: str = "llama"
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    rope: RopeScaling = field(default_factory=RopeScaling)

    @classmethod
    def from_hf_dict(cls, raw: dict, source: str = "") -> ModelConfig:
        """Validates an HF config.json dict; raises UnsupportedModelError with the reason
        (prefixed with source, the file it came from, when given), also for a missing or
        mistyped field."""
        where = f"{source}: " if source else ""
        try:
            return cls._from_hf_fields(raw)
        except UnsupportedModelError as err:
            raise UnsupportedModelError(f"{where}{err}") from None
        except KeyError as err:
            raise UnsupportedModelError(f"{where}no {err.args[0]!r} field; a Hugging Face "
                                        f"config.json of a supported family has it") from None
        except (TypeError, ValueError, IndexError) as err:
            raise UnsupportedModelError(f"{where}a field has the wrong type or is empty "
                                        f"({err})") from None

    @classmethod
    def _from_hf_fields(cls, raw: dict) -> ModelConfig:
        family = family_for(raw)
        try:
            rope = RopeScaling.from_hf_dict(raw)
        except RopeConfigError as err:
            raise UnsupportedModelError(str(err)) from None
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        if head_dim % 2:
            raise UnsupportedModelError(f"head_dim {head_dim} is odd; RoPE needs an even head_dim")
        return cls(
            architecture=raw["architectures"][0],
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            family=family.name,
            qk_norm=family.qk_norm,
            rope=rope,
        )
