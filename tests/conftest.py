"""Shared fixtures. Tests that start real service processes are marked `slow`."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton decides interpreted-or-compiled for its own library functions (tl.zeros, ...) when
    # triton.language is first imported, and our kernel modules import triton: the variable must
    # be set before any test module is collected, not only in tests/kernels/conftest.py.
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
