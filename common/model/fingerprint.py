"""A model fingerprint: sha256 over the architecture-relevant config and every weight byte.

Two services agree on a fingerprint only when they run the same weights under the same
config; decode refuses KV from a prefill whose fingerprint differs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

IGNORED_CONFIG_KEYS = ("transformers_version", "torch_dtype", "dtype", "use_cache")


def _config_digest(raw: dict) -> bytes:
    kept = {k: v for k, v in raw.items() if k not in IGNORED_CONFIG_KEYS}
    return json.dumps(kept, sort_keys=True).encode()


def fingerprint_checkpoint(root: Path) -> str:
    """Hashes config.json (canonical) and the full bytes of each *.safetensors file, in name
    order."""
    digest = hashlib.sha256(_config_digest(json.loads((root / "config.json").read_text())))
    for path in sorted(root.glob("*.safetensors")):
        digest.update(path.name.encode())
        with path.open("rb") as handle:
            while block := handle.read(1 << 24):
                digest.update(block)
    return "sha256:" + digest.hexdigest()


def fingerprint_weights(raw_config: dict, weights: dict[str, torch.Tensor]) -> str:
    """The same idea for weights made in memory (the demo model)."""
    digest = hashlib.sha256(_config_digest(raw_config))
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].contiguous().view(torch.uint8).numpy().tobytes())
    return "sha256:" + digest.hexdigest()
