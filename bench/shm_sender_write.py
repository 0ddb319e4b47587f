"""Prefill's write of a handoff into its shared-memory region (prefill_svc.shm_sender: pack and
chunk of every layer, as the engine calls them), with the region's file from a RegionPool and
released by the peer (so the file is reused), the two ways side by side, rounds interleaved:

- pwritev: each chunk's views of the pages written by system call (a pooled file's writable
  mapping turned off);
- kept mapping: packed into the reused file through the mapping it keeps (the sender now).

    PYTHONPATH=. python bench/shm_sender_write.py [--mib 64] [--rounds 7]

Prints this thread's CPU ms per handoff (time.thread_time), medians, and kept mapping / pwritev.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from common.handoff.layout import KvLayout
from common.handoff.region_pool import PooledFile, RegionPool
from common.kvpool.kv_cache import KvPool, PoolConfig
from prefill_svc.shm_sender import SharedMemorySender

PAGE = 16


@dataclass(frozen=True)
class Setup:
    layout: KvLayout
    pool: KvPool
    tokens: int
    directory: str


def handoff(setup: Setup, regions: RegionPool, n: int) -> float:
    """One handoff written and released by its peer -> CPU seconds of pack + chunk."""
    sender = SharedMemorySender(f"r{n}", setup.layout, setup.tokens, setup.directory, regions)
    table = torch.arange(0, setup.tokens // PAGE, dtype=torch.int32)  # [pages]
    started = time.thread_time()
    for layer in range(setup.layout.num_layers):
        k, v = setup.pool.k[layer], setup.pool.v[layer]  # [P, S, Hkv, D]
        kv = sender.pack(None, k, v, table, 0, setup.tokens)
        assert sender.chunk(f"r{n}", layer, layer, 0, kv, b"n" * 16) is not None
    spent = time.thread_time() - started
    sender.release(True, peer_done=True)
    return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=64, help="handoff size (KV payload), MiB")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--shm-dir", default="/dev/shm")
    args = p.parse_args()
    torch.set_num_threads(1)
    layout = KvLayout(32, 8, 128, torch.bfloat16)
    tokens = (args.mib << 20) // layout.kv_bytes_per_token
    pool = KvPool(PoolConfig(pool_tokens=tokens, page_size=PAGE), 32, 8, 128, torch.bfloat16,
                  torch.device("cpu"))
    for cache in (pool.k, pool.v):
        cache.normal_()
    setup = Setup(layout, pool, tokens, args.shm_dir)
    mapped_writable = PooledFile.writable
    ways = {"pwritev": lambda self, n: None, "kept mapping": mapped_writable}
    pools = {name: RegionPool() for name in ways}
    times: dict[str, list[float]] = {name: [] for name in ways}
    try:
        for n in range(args.rounds + 2):  # two warm-ups: the file's first use, then its mapping
            for name, writable in ways.items():
                PooledFile.writable = writable
                spent = handoff(setup, pools[name], n)
                if n >= 2:
                    times[name].append(spent)
    finally:
        PooledFile.writable = mapped_writable
        for regions in pools.values():
            regions.close()
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"{args.mib} MiB handoff ({tokens} tokens x {layout.num_layers} layers): "
          f"CPU ms per handoff, median of {args.rounds}")
    for name, sec in medians.items():
        print(f"  {name:14s} {sec * 1e3:8.1f}")
    print(f"  kept mapping / pwritev: {medians['kept mapping'] / medians['pwritev']:.2f}")


if __name__ == "__main__":
    main()
