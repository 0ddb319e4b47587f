"""How decode lands one shared-memory chunk in its pages with both byte checks (CRC-32C of K || V,
finiteness), the alternatives side by side in one process, rounds interleaved:

- bare pread: one pread of K and one of V into decode's own buffer (as big as the region), no
  check (what the bare shared-memory baseline does per piece, bench/transfer_bare.py), the floor;
- preadv into the pages: the same into a reservation's pages, no check (the copy alone);
- preadv, then pass: one preadv per side straight into the pages, then one block-interleaved
  pass over the pages for both checks (decode_svc.payload_pass, the receiver before issue 24);
- pread per block: decode_svc.inline_landing.land_blocks, one pread per block into the
  pages, both checks over the block while it is in cache (the receiver now);
- mmap per block: the same pass copying each block out of a read-only mapping of the region
  (measured only: a region the peer truncates would fault decode, common.handoff.shm_region;
  and the mapping here is made once, its page faults paid in the warm-up, where the services
  would map a new region per handoff: on this host, mapping and faulting 64 MiB afresh cost
  as much as the pread it saves, MAP_POPULATE or not).

    PYTHONPATH=. python bench/shm_landing.py [--chunk-mib 2,4] [--chunks 64] [--rounds 5]

Prints ms of this thread's CPU per chunk (time.thread_time: less swayed than wall time by other
processes on a loaded host) and GB/s, medians over rounds, and each row's ratio to bare pread.
--block-kib picks the landing rows' block sizes.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time

import numpy as np
import torch

from common.handoff.layout import KvLayout
from common.handoff.page_pieces import cache_bytes, kv_pieces
from common.handoff.shm_region import RegionReader, RegionWriter
from common.kvpool.kv_cache import KvPool
from decode_svc.inline_landing import land_blocks
from bench.transfer_breakdown import random_host_pool
from decode_svc.payload_pass import check_payload

PAGE = 16


def _region_fill(reader: RegionReader, offset: int):
    def fill(at: int, part: np.ndarray) -> None:
        reader.read_into(offset + at, part)
    return fill


def _mapped_fill(mapped: np.ndarray, offset: int):
    def fill(at: int, part: np.ndarray) -> None:
        np.copyto(part, mapped[offset + at:offset + at + part.size])
    return fill


def rows(layout: KvLayout, pool: KvPool, tokens: int, chunks: int, shm_dir: str,
         blocks: list[int]):
    """-> {row: fn(i)} landing chunk i (of `chunks` distinct ones in one region)."""
    side = tokens * layout.k_bytes_per_token_per_layer  # bytes of K (and of V) per chunk
    layers = layout.num_layers
    table = np.arange(0, tokens // PAGE, dtype=np.int32)  # [pages]
    landing = [kv_pieces(cache_bytes(pool.k[layer]), cache_bytes(pool.v[layer]),
                         layout.k_bytes_per_token_per_layer, table, PAGE, 0, tokens)
               for layer in range(layers)]
    writer = RegionWriter(shm_dir, chunks * 2 * side)
    source = cache_bytes(pool.k[0])[:side]  # [side] uint8: finite values
    for i in range(2 * chunks):
        writer.write(i * side, source)
    reader = RegionReader(shm_dir, writer.name)
    own = np.empty((chunks, 2, side), np.uint8)  # decode's own buffer, as big as the region
    fd = open(writer.path, "rb")
    mapping = mmap.mmap(fd.fileno(), chunks * 2 * side, prot=mmap.PROT_READ)
    mapped = np.frombuffer(mapping, np.uint8)  # [region bytes]

    def bare(i):
        reader.read_into(2 * i * side, own[i, 0])
        reader.read_into((2 * i + 1) * side, own[i, 1])

    def preadv_only(i):
        pieces = landing[i % layers]
        reader.scatter_into(2 * i * side, pieces.k.pieces)
        reader.scatter_into((2 * i + 1) * side, pieces.v.pieces)

    def preadv_then_pass(i):
        pieces = landing[i % layers]
        reader.scatter_into(2 * i * side, pieces.k.pieces)
        reader.scatter_into((2 * i + 1) * side, pieces.v.pieces)
        assert check_payload(pieces.k, pieces.v, layout.dtype).finite

    def per_block(fill, source, block):
        """fill(source, offset): _region_fill over the reader or _mapped_fill over the mapping."""
        def land(i):
            pieces = landing[i % layers]
            assert land_blocks(fill(source, 2 * i * side), fill(source, (2 * i + 1) * side),
                               pieces.k, pieces.v, layout.dtype, block).finite
        return land

    def close():  # the mapping goes with the last row that holds it
        fd.close()
        reader.close()
        writer.close()

    fns = {"bare pread (no checks)": bare, "preadv into the pages (no checks)": preadv_only,
           "preadv, then pass": preadv_then_pass}
    fns.update({f"pread per {b >> 10} KiB + checks": per_block(_region_fill, reader, b)
                for b in blocks})
    fns.update({f"mmap per {b >> 10} KiB + checks": per_block(_mapped_fill, mapped, b)
                for b in blocks})
    return fns, close


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunk-mib", default="2,4", help="chunk sizes (K plus V), MiB")
    p.add_argument("--chunks", type=int, default=64, help="distinct chunks per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--block-kib", default="128,256", help="landing block sizes, KiB")
    p.add_argument("--shm-dir", default="/dev/shm")
    args = p.parse_args()
    torch.set_num_threads(1)
    layout = KvLayout(32, 8, 128, torch.bfloat16)
    sizes = [int(s) for s in args.chunk_mib.split(",")]
    pool = random_host_pool(layout, max(sizes) * (1 << 20) // layout.kv_bytes_per_token_per_layer)
    for mib in sizes:
        tokens = mib * (1 << 20) // layout.kv_bytes_per_token_per_layer
        size = tokens * layout.kv_bytes_per_token_per_layer
        blocks = [int(b) << 10 for b in args.block_kib.split(",")]
        fns, close = rows(layout, pool, tokens, args.chunks, args.shm_dir, blocks)
        times: dict[str, list[float]] = {name: [] for name in fns}
        try:
            for fn in fns.values():
                fn(0)  # warm-up
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    started = time.thread_time()
                    for i in range(args.chunks):
                        fn(i)
                    times[name].append((time.thread_time() - started) / args.chunks)
        finally:
            close()
        floor = statistics.median(times["bare pread (no checks)"])
        print(f"chunk {mib} MiB ({tokens} tokens of one layer): CPU ms per chunk (GB/s), x bare")
        for name, seconds in times.items():
            sec = statistics.median(seconds)
            print(f"  {name:34s} {sec * 1e3:7.3f} ({size / sec / 1e9:5.2f})  {floor / sec:5.2f}")


if __name__ == "__main__":
    main()
