"""What decode's content checks (SPEC.md D-45..D-48) cost per handoff, part by part, beside the
prefill pass they check: one process, no services, the model and a pool as decode builds them.

    PYTHONPATH=. python bench/ttft_checks.py --model DIR [--tokens 128,512]
                 [--dtypes float32,bfloat16] [--repeats 20] [--clock thread]

The prompt is prefilled into its pages (the honest KV), then each part runs alone, the parts
taking turns repeat after repeat: layer 0's K/V recomputed (`layer0_kv`), layer 0's comparison
(pack the received + relative error), the depth step (gather, one decode step of 1 +
depth_positions rows, gather, compare), the first token's sampling, and the whole
`check_content` as the engine runs it. With ``--clock thread`` (torch on one thread) each part
is this thread's CPU time, so a loaded host's neighbours do not count. Medians, ms.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from common.kvpool.kv_cache import KvPool, PoolConfig
from common.model.loader import load_model
from common.model.protocol import PrefillBatch
from common.model.registry import build_model
from common.ops.select import make_ops
from common.sampling import SamplingConfig, sample_batch
from decode_svc.content_check import (ContentCheckConfig, _depth_error, _layer0_error,
                                      check_content)
from decode_svc.kv_difference import relative_error

PAGE_SIZE = 16


def _prefill(model, pool: KvPool, request_id: str, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    pages = pool.allocator.allocate(request_id, n)
    slots = torch.tensor([pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(n)],
                         dtype=torch.int64)
    batch = PrefillBatch(token_ids=torch.tensor(ids), positions=torch.arange(n),
                         slot_mapping=slots, cu_seqlens=torch.tensor([0, n], dtype=torch.int32),
                         max_seqlen=n)
    return model.prefill(batch, pool.k, pool.v)


def parts_ms(model, tokens: int, repeats: int, clock, depth_positions: int = 4) -> dict:
    c = model.config
    pool = KvPool(PoolConfig(pool_tokens=(tokens // PAGE_SIZE + 2) * PAGE_SIZE * 2,
                             page_size=PAGE_SIZE), c.num_layers, c.num_kv_heads, c.head_dim,
                  model.dtype, torch.device("cpu"))
    ids_list = [(7 * i + 3) % (c.vocab_size - 3) + 3 for i in range(tokens)]
    _prefill(model, pool, "r", ids_list)
    pages = pool.allocator.page_table("r")
    table = torch.tensor(pages, dtype=torch.int32)
    ids = torch.tensor(ids_list, dtype=torch.int64)
    positions = torch.arange(tokens)
    rng = random.Random(0)
    config = ContentCheckConfig(depth_positions=depth_positions)
    sampling = SamplingConfig()
    logits = torch.zeros(1, c.vocab_size)

    def layer0_recompute():
        model.layer0_kv(ids, positions)

    k0, v0 = model.layer0_kv(ids, positions)

    def layer0_compare():
        received = model.ops.pack_kv(pool.k[0], pool.v[0], table, 0, tokens)
        max(relative_error(received[0], k0), relative_error(received[1], v0))

    def depth():
        others = rng.sample(range(tokens - 1), min(depth_positions, tokens - 1))
        _depth_error(model, pool, pages, table, ids, [tokens - 1, *sorted(others)])

    def sample():
        sample_batch(logits, [sampling], [0])

    def whole():
        check_content(model, pool, "r", ids_list, sampling, config, rng)

    def prefill_pass():  # the pass prefill runs for this prompt (decode's local prefill too)
        _prefill(model, pool, "p", ids_list)
        pool.release("p")

    fns = {"layer0: recompute (layer0_kv)": layer0_recompute,
           "layer0: pack received + compare": layer0_compare,
           "layer0: whole (_layer0_error)": lambda: _layer0_error(model, pool, table, ids),
           f"depth: 1+{depth_positions} rows, gather/decode/compare": depth,
           "first token: sample": sample,
           "check_content, all of it": whole,
           "for scale: the prefill pass itself": prefill_pass}
    for fn in fns.values():
        fn()  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            started = clock()
            fn()
            samples[name].append(clock() - started)
    return {name: statistics.median(s) * 1e3 for name, s in samples.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a checkpoint directory")
    p.add_argument("--tokens", default="128,512")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--kernels", default="cpu")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--depth-positions", type=int, default=4)
    p.add_argument("--clock", default="thread", choices=("wall", "thread"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    loaded = load_model(args.model)
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        model = build_model(loaded.config, loaded.weights,
                            make_ops(args.kernels, torch.device("cpu")), torch.device("cpu"),
                            dtype)
        for tokens in (int(t) for t in args.tokens.split(",")):
            parts = parts_ms(model, tokens, args.repeats, clock, args.depth_positions)
            print(f"{args.model}, {dtype_name}, {tokens} tokens, {args.kernels} ops, 1 torch "
                  f"thread, {args.clock} clock, medians of {args.repeats}, ms")
            for name, ms in parts.items():
                print(f"  {name:48s} {ms:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
