"""How far received KV is from decode's own recomputation: the one measure every content check
uses (layer 0, the depth positions, the full audit), max |received - recomputed| / rms(recomputed)
in float32, where NaN or infinity reads as infinitely far."""

from __future__ import annotations

import math

import torch


def relative_error_by_row(received: torch.Tensor, recomputed: torch.Tensor) -> torch.Tensor:
    """received, recomputed: [rows, ...] -> [rows]: each row's max |received - recomputed| /
    rms(recomputed), the rms over the whole tensor, in float32; inf where not finite (NaN
    compares false with any tolerance, so it must never reach the comparison). No device sync."""
    ours = recomputed.float()
    scale = ours.pow(2).mean().sqrt().clamp_min(1e-12)
    worst = (received.float() - ours).abs().flatten(1).amax(dim=1) / scale  # [rows]
    return torch.nan_to_num(worst, nan=math.inf)


def relative_error(received: torch.Tensor, recomputed: torch.Tensor) -> float:
    """max |received - recomputed| / rms(recomputed) over the whole tensor (the largest row of
    `relative_error_by_row`); inf when not finite."""
    return float(relative_error_by_row(received, recomputed).max().item())
