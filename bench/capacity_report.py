"""Pool sizes chosen by --memory-fraction for the demo model and a Llama-3-8B-shaped config.

    python bench/capacity_report.py [--fraction 0.9]

On CUDA the weights' bytes are really allocated first (as a service holds them), then the
pool is sized from the free memory that is left; on the CPU it uses --kv-cache-bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from common.capacity import plan_capacity
from common.config import ServiceConfig
from common.model.config import ModelConfig
from common.model.demo import demo_hf_config

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 14336, "rope_theta": 500000.0, "max_position_embeddings": 8192,
}


def weight_count(c: ModelConfig) -> int:
    attn = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    attn += c.num_heads * c.head_dim * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return c.num_layers * (attn + mlp) + embed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fraction", type=float, default=0.9)
    parser.add_argument("--kv-cache-bytes", type=int, default=8 << 30, help="CPU budget")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    print(f"device={device} dtype={dtype} fraction={args.fraction}")
    print(f"{'model':<12}{'weights GiB':>12}{'KV B/token':>12}{'pool tokens':>14}"
          f"{'pool GiB':>10}{'window':>8}  sized by")
    for name, raw in [("demo", demo_hf_config(98)), ("llama3-8b", LLAMA3_8B)]:
        model = ModelConfig.from_hf_dict(raw)
        nbytes = weight_count(model) * torch.empty((), dtype=dtype).element_size()
        held = torch.empty(nbytes, dtype=torch.uint8, device=device) if cuda else None
        config = ServiceConfig(pool_tokens=0, memory_fraction=args.fraction,
                               kv_cache_bytes=0 if cuda else args.kv_cache_bytes)
        cap = plan_capacity(config, model, dtype, device)
        print(f"{name:<12}{nbytes / 2**30:>12.2f}{cap.kv_bytes_per_token:>12}"
              f"{cap.pool_tokens:>14}{cap.pool_bytes / 2**30:>10.2f}{cap.context_window:>8}"
              f"  {cap.sized_by}")
        del held
        if cuda:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
