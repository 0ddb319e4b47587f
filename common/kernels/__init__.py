"""Triton kernels, one per file, each beside the torch reference it must match."""
