"""How close legitimate handoffs come to decode's content-check tolerances (SPEC.md 7.4).

Prefill runs on one backend and dtype, decode checks on another, exactly as the services do it
(prefill's pool -> packed per layer -> decode's pages, in a shuffled page order), for prompts of
mixed lengths; every handoff must be accepted, and the report gives the largest error seen
against the tolerance (the margin). In process, without gRPC: the bytes are the same.

    python -m bench.verify_margin --pairs torch:torch,torch:triton --handoffs 200
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass

import torch

from common.kvpool.kv_cache import KvPool, PoolConfig
from common.model.demo import build_demo_model
from common.model.llama import LlamaModel, PrefillBatch
from common.ops.select import make_ops
from common.sampling import SamplingConfig, sample_batch
from decode_svc.content_check import TOLERANCES, ContentCheckConfig, check_content

PAGE_SIZE = 16


@dataclass(frozen=True)
class Margin:
    pair: str
    dtype: str
    handoffs: int
    layer0_max: float
    depth_max: float
    layer0_tolerance: float
    depth_tolerance: float
    first_token_disagreements: int
    seconds: float

    @property
    def layer0_margin(self) -> float:
        """tolerance / largest legitimate error (higher is safer)."""
        return self.layer0_tolerance / max(self.layer0_max, 1e-30)

    @property
    def depth_margin(self) -> float:
        return self.depth_tolerance / max(self.depth_max, 1e-30)


def model_on(backend: str, dtype: torch.dtype, device: str = "cpu") -> LlamaModel:
    loaded = build_demo_model()
    target = torch.device(device)
    return LlamaModel(loaded.config, loaded.weights, make_ops(backend, target), target, dtype)


def _pool(model: LlamaModel, tokens: int) -> KvPool:
    c = model.config
    return KvPool(PoolConfig(tokens, PAGE_SIZE), c.num_layers, c.num_kv_heads, c.head_dim,
                  model.dtype, model.device)


def prefill_kv(model: LlamaModel, prompt: list[int]) -> tuple[list[torch.Tensor], int]:
    """Prefill of one prompt into fresh pages -> per-layer [2, n, Hkv, D] CPU KV, first token."""
    n, device = len(prompt), model.device
    pool = _pool(model, (n // PAGE_SIZE + 1) * PAGE_SIZE)
    pages = pool.allocator.allocate("p", n)
    batch = PrefillBatch(
        token_ids=torch.tensor(prompt, device=device), positions=torch.arange(n, device=device),
        slot_mapping=torch.tensor(pool.slots_for(pages, 0, n), device=device),
        cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=device), max_seqlen=n)
    logits = model.prefill(batch, pool.k, pool.v)
    table = torch.tensor(pages, dtype=torch.int32, device=device)
    kv = [model.ops.pack_kv(pool.k[layer], pool.v[layer], table, 0, n).cpu()
          for layer in range(model.config.num_layers)]
    return kv, sample_batch(logits, [SamplingConfig()], [0])[0]


def check_on_decode(model: LlamaModel, prompt: list[int], kv: list[torch.Tensor],
                    rng: random.Random, config: ContentCheckConfig):
    """Lands the KV in shuffled pages of a decode pool and runs the content checks."""
    n = len(prompt)
    pool = _pool(model, (2 * (n // PAGE_SIZE + 1) + 4) * PAGE_SIZE)
    free = pool.allocator.num_pages - pool.allocator.pages_needed(n)
    spacers = [f"spacer{k}" for k in range(free)]
    for name in spacers:  # fragment the free list so that the request's pages are scattered
        pool.allocator.allocate(name, 1)
    for name in rng.sample(spacers, len(spacers) // 2):
        pool.allocator.free(name)
    pages = pool.allocator.allocate("d", n)
    table = torch.tensor(pages, dtype=torch.int32, device=model.device)
    for layer, buffer in enumerate(kv):
        model.ops.unpack_kv(buffer.to(model.device, model.dtype), pool.k[layer], pool.v[layer],
                            table, 0)
    return check_content(model, pool, "d", prompt, SamplingConfig(), config, rng)


def lengths(count: int, rng: random.Random) -> list[int]:
    """1 token, exactly one page, several pages plus a remainder, and random lengths between."""
    fixed = [1, 2, PAGE_SIZE - 1, PAGE_SIZE, PAGE_SIZE + 1, 3 * PAGE_SIZE + 5, 5 * PAGE_SIZE + 7]
    return (fixed + [rng.randint(1, 6 * PAGE_SIZE) for _ in range(count)])[:count]


def measure(pair: str, dtype: torch.dtype, handoffs: int, seed: int = 0,
            device: str = "cpu") -> Margin:
    """Raises HandoffRefused at the first legitimate handoff that the checks refuse."""
    prefill_backend, decode_backend = pair.split(":")
    prefill_model = model_on(prefill_backend, dtype, device)
    decode_model = model_on(decode_backend, dtype, device)
    rng = random.Random(seed)
    vocab = prefill_model.config.vocab_size
    config = ContentCheckConfig()
    l0 = depth = 0.0
    disagree = 0
    started = time.perf_counter()
    for n in lengths(handoffs, rng):
        prompt = [rng.randrange(2, vocab) for _ in range(n)]
        kv, first = prefill_kv(prefill_model, prompt)
        verdict = check_on_decode(decode_model, prompt, kv, rng, config)
        l0, depth = max(l0, verdict.layer0_error), max(depth, verdict.depth_error)
        disagree += verdict.first_token_id != first
    tol = TOLERANCES[dtype]
    return Margin(pair, str(dtype).removeprefix("torch."), handoffs, l0, depth, tol.layer0,
                  tol.depth, disagree, time.perf_counter() - started)


def check_cost(lengths_to_time: list[int], repeats: int = 3, backend: str = "torch",
               device: str = "cpu") -> list[tuple[int, float, float]]:
    """(prompt tokens, prefill seconds, content-check seconds), medians of repeats, in process:
    the checks' cost against the prefill they verify, without gRPC or a second process."""
    torch.set_num_threads(1)  # as each service runs in `bench ttft`: one thread, comparable
    model = model_on(backend, torch.float32, device)
    rng = random.Random(0)
    rows = []
    for n in lengths_to_time:
        prompt = [rng.randrange(2, model.config.vocab_size) for _ in range(n)]
        prefills, checks = [], []
        for _ in range(repeats + 1):  # the first round warms up
            started = time.perf_counter()
            kv, _ = prefill_kv(model, prompt)
            prefills.append(time.perf_counter() - started)
            checks.append(check_on_decode(model, prompt, kv, rng, ContentCheckConfig()).seconds)
        rows.append((n, statistics.median(prefills[1:]), statistics.median(checks[1:])))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Measure how close legitimate handoffs come "
                                     "to decode's content-check tolerances.")
    parser.add_argument("--pairs", default="torch:torch", help="prefill:decode backends, "
                        "comma-separated (default: %(default)s)")
    parser.add_argument("--dtypes", default="float32", help="comma-separated dtypes "
                        "(default: %(default)s)")
    parser.add_argument("--handoffs", type=int, default=200, help="handoffs per pair and dtype "
                        "(default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    parser.add_argument("--timing", default="", help="prompt lengths (comma-separated) at "
                        "which to time prefill against the content checks, instead of margins")
    args = parser.parse_args(argv)
    if args.timing:
        for n, prefill_s, check_s in check_cost([int(x) for x in args.timing.split(",")],
                                                device=args.device):
            print(f"{n:6} tokens: prefill {prefill_s * 1e3:8.1f} ms, content checks "
                  f"{check_s * 1e3:7.1f} ms ({check_s / prefill_s:.1%} of the prefill)")
        return
    for dtype_name in args.dtypes.split(","):
        for pair in args.pairs.split(","):
            m = measure(pair, getattr(torch, dtype_name), args.handoffs, device=args.device)
            if args.json:
                print(json.dumps({**m.__dict__, "layer0_margin": m.layer0_margin,
                                  "depth_margin": m.depth_margin}))
            else:
                print(f"{m.pair:14} {m.dtype:9} n={m.handoffs:4}  layer0 max {m.layer0_max:.3g} "
                      f"(tol {m.layer0_tolerance:g}, margin {m.layer0_margin:.0f}x)  depth max "
                      f"{m.depth_max:.3g} (tol {m.depth_tolerance:g}, margin "
                      f"{m.depth_margin:.0f}x)  first-token disagreements "
                      f"{m.first_token_disagreements}  {m.seconds:.1f}s")


if __name__ == "__main__":
    main()
