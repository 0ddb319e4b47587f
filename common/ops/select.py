"""Picks the ops backend for a device: ``triton`` on CUDA, ``cpu`` (torch SDPA attention with
batched page gathers) on the CPU by default; ``torch`` is the reference every backend is tested
against."""

from __future__ import annotations

import os

import torch

from common.ops.interface import KernelOps
from common.ops.torch_ops import TorchOps

BACKENDS = ("auto", "triton", "torch", "cpu")


def resolve_backend(requested: str, device: torch.device) -> str:
    """'auto' -> 'triton' on a CUDA device, 'cpu' otherwise; explicit choices pass through."""
    if requested not in BACKENDS:
        raise ValueError(f"unknown kernel backend {requested!r}; choose one of {BACKENDS}")
    if requested == "auto":
        return "triton" if device.type == "cuda" else "cpu"
    return requested


def triton_is_interpreted(device: torch.device) -> bool:
    """True when Triton kernels would run through the interpreter (no GPU for them)."""
    return device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def make_ops(backend: str, device: torch.device) -> KernelOps:
    """Builds the backend; 'triton' on a CPU device needs TRITON_INTERPRET=1 set before start."""
    name = resolve_backend(backend, device)
    if name == "torch":
        return TorchOps()
    if name == "cpu":
        from common.ops.cpu_ops import CpuOps

        return CpuOps()
    from common.ops.triton_ops import TritonOps

    return TritonOps()
