"""What registering one handoff's pages with NIXL costs (SPEC P-68): prefill registers, per
NIXL handoff served from its pages, one region per layer and run of contiguous page slots, K and
V apart, and deregisters them before the pages go back. This times register (with the partial
agent metadata a peer loads) and deregister over a pool of the 8B-shaped layout, for handoffs of
1 GiB whose pages lie in 1, 8 or 64 runs (64, 512, 4096 regions), and prints the metadata size.
Then the scrub that precedes a registration (P-68a, prefill_svc.page_scrub: the handoff's slots
not written yet zeroed, all but layer 0 of its first pass) against the pack copy of the packed
path (P-66: every byte of the handoff copied into a buffer), interleaved per repeat, for the
same 1 GiB handoff in 1 run of pages.

`python -m bench.nixl_registration [--runs 1,8,64] [--repeats 9]`; UCX is confined to loopback
(common.handoff.nixl_agent.LOOPBACK_UCX) unless the environment sets it. On UCX's shared-memory
and TCP transports registration pins nothing; an RDMA NIC's would (not measured here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from common.handoff.nixl_agent import LOOPBACK_UCX, open_agent
from common.kvpool.kv_cache import KvPool, PoolConfig
from prefill_svc.page_scrub import scrub_unwritten

LAYERS, HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
PAGES = 512  # 8192 tokens: 1 GiB of K and V in bfloat16


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.nixl_registration")
    p.add_argument("--runs", default="1,8,64", help="runs of adjacent pages per handoff")
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    for key, value in LOOPBACK_UCX.items():
        os.environ.setdefault(key, value)
    agent, why = open_agent("bench-registration")
    if agent is None:
        print(f"NIXL is not usable here: {why}", file=sys.stderr)
        return 2
    # the pool: k, v [L, 2 * PAGES, S, Hkv, D]; the handoff takes every other run of pages
    k = torch.zeros(LAYERS, 2 * PAGES, PAGE, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    slot = HEADS * HEAD_DIM * k.element_size()
    layer = k[0].nbytes
    print(f"{'runs':>5} {'regions':>8} {'register ms':>12} {'deregister ms':>14} "
          f"{'metadata B':>11}")
    for runs in map(int, args.runs.split(",")):
        pages = PAGES // runs
        regions = [(cache.data_ptr() + lay * layer + 2 * r * pages * PAGE * slot,
                    pages * PAGE * slot)
                   for lay in range(LAYERS) for cache in (k, v) for r in range(runs)]
        register, deregister, meta = [], [], 0
        for _ in range(args.repeats):
            started = time.perf_counter()
            reg = agent.register_regions(regions, share=True)
            middle = time.perf_counter()
            agent.deregister(reg)
            register.append(middle - started)
            deregister.append(time.perf_counter() - middle)
            meta = len(reg.metadata)
        print(f"{runs:>5} {len(regions):>8} {1e3 * statistics.median(register):>12.2f} "
              f"{1e3 * statistics.median(deregister):>14.2f} {meta:>11}")
    scrub_vs_pack(args.repeats)
    return 0


def scrub_vs_pack(repeats: int) -> None:
    """The P-68a scrub of a 1 GiB handoff vs copying its bytes into a buffer (P-66's pack)."""
    pool = KvPool(PoolConfig(2 * PAGES * PAGE, PAGE), LAYERS, HEADS, HEAD_DIM, torch.bfloat16,
                  torch.device("cpu"))
    tokens = PAGES * PAGE
    table = pool.allocator.allocate("bench", tokens)
    buffer = torch.empty(2, LAYERS, tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    first = table[0]
    assert table == list(range(first, first + PAGES)), "one run of pages"
    scrub, pack, zeroed = [], [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        zeroed = scrub_unwritten(pool, "bench", table, tokens, tokens)
        middle = time.perf_counter()
        for side, cache in enumerate((pool.k, pool.v)):  # [L, P, S, Hkv, D], one run of pages
            buffer[side].view(LAYERS, PAGES, PAGE, HEADS, HEAD_DIM).copy_(
                cache[:, first:first + PAGES])
        scrub.append(middle - started)
        pack.append(time.perf_counter() - middle)
    handoff = 2 * LAYERS * tokens * HEADS * HEAD_DIM * 2
    print(f"scrub of a {handoff >> 20} MiB handoff ({zeroed >> 20} MiB zeroed): "
          f"{1e3 * statistics.median(scrub):.1f} ms; pack copy of it: "
          f"{1e3 * statistics.median(pack):.1f} ms (medians of {repeats}, interleaved)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
