"""RoPE frequencies and their scaling, read from a config's `rope_parameters` / `rope_scaling`.

Every supported scaling is a function of the position alone, so it becomes one cos|sin table
[max_positions, D] that the rope op (torch or Triton) indexes by position; nothing in the ops
changes per family. The formulas follow the published methods as transformers applies them:

- ``default``: inv_freq[i] = theta ** (-2i / D);
- ``linear``: inv_freq / factor (positions interpolated);
- ``dynamic`` (NTK): transformers rescales theta only once a sequence grows past
  max_position_embeddings; this server never serves beyond max_position_embeddings (the context
  window is capped there), so inside the window it is exactly ``default``;
- ``llama3``: low frequencies (wavelength > original / low_freq_factor) divided by factor,
  high ones (wavelength < original / high_freq_factor) kept, a linear blend in between;
- ``yarn``: per-dimension blend of interpolated and extrapolated frequencies over the
  correction range [beta_fast, beta_slow], and cos/sin multiplied by the attention factor
  (0.1 * ln(factor) + 1 unless given, or the mscale / mscale_all_dim ratio).

Refused (UnsupportedModelError naming the type): ``longrope``, ``proportional``, anything else,
and a partial_rotary_factor below 1 (the rope op rotates the whole head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class RopeConfigError(ValueError):
    """The rope parameters are of a type or shape this server does not implement."""


@dataclass(frozen=True)
class RopeScaling:
    """The rope parameters that shape the table; unused fields keep their defaults."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf_dict(cls, raw: dict) -> RopeScaling:
        """raw: a whole config.json dict (rope_parameters, the older rope_scaling, rope_theta)."""
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        if any(isinstance(v, dict) for v in rope.values()):
            raise RopeConfigError("per-layer-type rope parameters are not supported")
        rope_type = rope.get("rope_type", rope.get("type")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise RopeConfigError(f"rope type {rope_type!r} is not supported; supported: "
                                  f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if partial is not None and float(partial) != 1.0:
            raise RopeConfigError(f"partial_rotary_factor {partial} is not supported (only 1.0)")
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        original = int(raw.get("original_max_position_embeddings")
                       or rope.get("original_max_position_embeddings")
                       or raw.get("max_position_embeddings", 2048))
        factor = rope.get("factor")
        if rope_type != "default" and factor is None:
            if rope_type != "yarn":
                raise RopeConfigError(f"rope type {rope_type!r} needs a factor")
            factor = int(raw.get("max_position_embeddings", original)) / original
        return cls(
            rope_type=rope_type, theta=theta, factor=float(factor or 1.0),
            original_max_position_embeddings=original,
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            attention_factor=_optional_float(rope.get("attention_factor")),
            mscale=_optional_float(rope.get("mscale")),
            mscale_all_dim=_optional_float(rope.get("mscale_all_dim")),
            truncate=bool(rope.get("truncate", True)),
        )

    def inv_freq(self, head_dim: int) -> tuple[torch.Tensor, float]:
        """-> (inv_freq [head_dim / 2] float32, the factor cos and sin are multiplied by)."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        base = 1.0 / (self.theta ** exponents)  # [D/2]
        if self.rope_type in ("default", "dynamic"):
            return base, 1.0
        if self.rope_type == "linear":
            return base / self.factor, 1.0
        if self.rope_type == "llama3":
            return self._llama3(base), 1.0
        return self._yarn(head_dim)

    def _llama3(self, base: torch.Tensor) -> torch.Tensor:
        old = self.original_max_position_embeddings
        low_wavelen = old / self.low_freq_factor
        high_wavelen = old / self.high_freq_factor
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > low_wavelen, base / self.factor, base)
        smooth = (old / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, blended, scaled)

    def _yarn(self, dim: int) -> tuple[torch.Tensor, float]:
        pos_freqs = self.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [D/2]
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)
        low, high = self._correction_range(dim)
        if low == high:
            high += 0.001  # a one-point range would divide by zero
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (high frequency), 0: interpolate
        inv_freq = interpolation * (1 - keep) + extrapolation * keep
        return inv_freq, self._yarn_attention_factor()

    def _correction_range(self, dim: int) -> tuple[float, float]:
        orig = self.original_max_position_embeddings

        def dim_of(rotations: float) -> float:
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def _yarn_attention_factor(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)

    def table(self, max_positions: int, head_dim: int, device: torch.device) -> torch.Tensor:
        """-> [max_positions, head_dim] float32: cos in the first head_dim/2 columns, sin in the
        rest, both already multiplied by the attention factor (the rope op's layout)."""
        inv_freq, scale = self.inv_freq(head_dim)
        positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, D/2]
        return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1).to(device)


def _optional_float(value) -> float | None:
    return None if value is None else float(value)
