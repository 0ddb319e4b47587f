"""Picks the ops backend for a device: ``triton`` on CUDA, ``torch`` on the CPU by default."""

from __future__ import annotations

import os

import torch

from common.ops.interface import KernelOps
from common.ops.torch_ops import TorchOps

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(requested: str, device: torch.device) -> str:
    """'auto' -> 'triton' on a CUDA device, 'torch' otherwise; explicit choices pass through."""
    if requested not in BACKENDS:
        raise ValueError(f"unknown kernel backend {requested!r}; choose one of {BACKENDS}")
    if requested == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return requested


def triton_is_interpreted(device: torch.device) -> bool:
    """True when Triton kernels would run through the interpreter (no GPU for them)."""
    return device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def make_ops(backend: str, device: torch.device) -> KernelOps:
    """Builds the backend; 'triton' on a CPU device needs TRITON_INTERPRET=1 set before start."""
    name = resolve_backend(backend, device)
    if name == "torch":
        return TorchOps()
    from common.ops.triton_ops import TritonOps

    return TritonOps()
