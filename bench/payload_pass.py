"""Decode's two byte checks on a landed chunk (CRC-32C of K || V, finiteness of every value):
two passes over the chunk vs one block-interleaved pass (decode_svc.payload_pass) at several
block sizes, and, for the shared-memory plane, the landing as a whole: preadv of the region
into the pages then the checks, vs preadv block by block with both checks on each block while
it is in cache. Alternatives alternate call by call, in one process on one thread;
each prints its median GB/s and its ratio to today's two passes.

    PYTHONPATH=. python bench/payload_pass.py [--chunk-mib 1,4] [--rounds 7] [--layers 32]

Every alternative's (crc, finite) is checked equal to the two passes' before timing.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
import torch

from common.handoff.crc import payload_crc32c
from common.handoff.layout import KvLayout
from common.handoff.page_pieces import cache_bytes, kv_pieces
from common.handoff.scattered import ScatteredBytes
from common.handoff.shm_region import RegionReader, RegionWriter
from common.kvpool.kv_cache import KvPool, PoolConfig
from decode_svc.finite_bits import all_finite_pieces
from decode_svc.payload_pass import check_payload

PAGE = 16


def two_passes(k: ScatteredBytes, v: ScatteredBytes, dtype) -> tuple[int, bool]:
    """Today's checks: the verifier's CRC-32C, then the engine's finiteness pass."""
    return payload_crc32c(k, v), all_finite_pieces(k.pieces + v.pieces, dtype)


def one_pass(k, v, dtype, block: int) -> tuple[int, bool]:
    check = check_payload(k, v, dtype, block)
    return check.crc32c, check.finite


def _blocks(pieces, block: int):
    for piece in pieces:
        for start in range(0, piece.size, block):
            yield piece[start:start + block]


def land_blockwise(reader: RegionReader, offset: int, k: ScatteredBytes, v: ScatteredBytes,
                   dtype, block: int) -> tuple[int, bool]:
    """preadv of each block of K then V, then both checks over that block (still in cache)."""
    at = offset
    parts = []
    for part in _blocks(k.pieces + v.pieces, block):
        reader.read_into(at, part)
        at += part.size
        parts.append(part)
    return one_pass(ScatteredBytes(tuple(parts), at - offset), ScatteredBytes((), 0), dtype,
                    block)


def _time_interleaved(group: dict, args: dict, layers: int, rounds: int) -> dict[str, float]:
    """Median seconds per call of each alternative: call s runs alternative s % n on chunk
    s % layers (n and layers coprime), so the alternatives alternate call by call under the
    same load and no call finds its chunk in cache from the call before."""
    names = list(group)
    n = len(names)
    while math.gcd(n, layers) != 1:
        layers -= 1  # every alternative visits every chunk
    times: dict[str, list] = {name: [] for name in names}
    for step in range(rounds * n * layers):
        name = names[step % n]
        fn = group[name][0]
        a = args[name][step % layers]
        started = time.perf_counter()
        fn(*a)
        times[name].append(time.perf_counter() - started)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run(chunk_mib: int, layers: int, rounds: int, shm_dir: str, blocks: list[int]) -> None:
    layout = KvLayout(layers, 8, 128, torch.bfloat16)
    row = layout.k_bytes_per_token_per_layer  # K (or V) bytes per token slot
    tokens = chunk_mib * (1 << 20) // (2 * row)  # K plus V = chunk_mib
    pool = KvPool(PoolConfig(pool_tokens=tokens, page_size=PAGE), layers, 8, 128,
                  torch.bfloat16, torch.device("cpu"))
    for cache in (pool.k, pool.v):
        cache.normal_()
    table = np.arange(tokens // PAGE, dtype=np.int32)
    k_bytes, v_bytes = cache_bytes(pool.k), cache_bytes(pool.v)
    landed = [kv_pieces(k_bytes[layer], v_bytes[layer], row, table, PAGE, 0, tokens)
              for layer in range(layers)]
    size = 2 * tokens * row
    dtype = layout.dtype
    expected = [two_passes(p.k, p.v, dtype) for p in landed]

    alternatives = {"two passes (today)": (two_passes, lambda p: (p.k, p.v, dtype))}
    for block in blocks:
        alternatives[f"one pass, {block >> 10} KiB blocks"] = (
            one_pass, lambda p, b=block: (p.k, p.v, dtype, b))
    writer = RegionWriter(shm_dir, layers * size)
    try:
        for layer, p in enumerate(landed):
            writer.write(layer * size, p.k)
            writer.write(layer * size + size // 2, p.v)
        reader = RegionReader(shm_dir, writer.name)

        def land_then(check):
            def go(layer, p, *rest):
                reader.scatter_into(layer * size, p.k.pieces)
                reader.scatter_into(layer * size + size // 2, p.v.pieces)
                return check(p.k, p.v, *rest)
            return go

        landing = {"land: preadv, then two passes (today)": (
            land_then(two_passes), lambda layer, p: (layer, p, dtype))}
        for block in blocks:
            landing[f"land: preadv, then one pass {block >> 10} KiB"] = (
                land_then(one_pass), lambda layer, p, b=block: (layer, p, dtype, b))
            landing[f"land: preadv + checks per {block >> 10} KiB block"] = (
                lambda layer, p, d, b: land_blockwise(reader, layer * size, p.k, p.v, d, b),
                lambda layer, p, b=block: (layer, p, dtype, b))
        table_rows = []
        for group in (alternatives, landing):
            args = {}
            for name, (fn, make) in group.items():
                if group is alternatives:
                    args[name] = [make(p) for p in landed]
                else:
                    args[name] = [make(layer, p) for layer, p in enumerate(landed)]
                got = [fn(*a) for a in args[name]]
                assert got == expected, name
            seconds = _time_interleaved(group, args, layers, rounds)
            base = next(iter(seconds.values()))
            for name, sec in seconds.items():
                table_rows.append((name, size / sec / 1e9, base / sec))
            table_rows.append(None)
        reader.close()
    finally:
        writer.close()
    print(f"chunk {chunk_mib} MiB (K+V, {tokens} tokens of a Llama-3-8B layer, bf16), "
          f"median per chunk of {rounds} x {layers} calls each, interleaved call by call")
    print(f"  {'alternative':48s} {'GB/s':>7} {'x today':>8}")
    for line in table_rows:
        if line is None:
            print()
            continue
        name, gbs, ratio = line
        print(f"  {name:48s} {gbs:7.2f} {ratio:8.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunk-mib", default="1,4", help="chunk sizes (K plus V), MiB")
    p.add_argument("--layers", type=int, default=32, help="chunks timed per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--blocks-kib", default="64,128,256,1024")
    p.add_argument("--shm-dir", default="/dev/shm")
    args = p.parse_args()
    torch.set_num_threads(1)
    blocks = [int(b) << 10 for b in args.blocks_kib.split(",")]
    for mib in (int(s) for s in args.chunk_mib.split(",")):
        run(mib, args.layers, args.rounds, args.shm_dir, blocks)


if __name__ == "__main__":
    main()
