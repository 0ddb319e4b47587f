"""Where a handoff's time goes, step by step, per chunk of a Llama-3-8B-shaped layer (K plus V,
bf16), in one process on one torch thread: each step as the services did it before issue 12's
speed work ("before"), after stop 11's ("stop 11") and as they do it now ("now": chunks move
straight between the pages and the transport), side by side in one run.

    PYTHONPATH=. python bench/transfer_breakdown.py [--chunks 32] [--chunk-mib 1,4]

Prefill: pack out of the pages, crc32c, the inline frame, the write into a shared-memory region.
Decode: crc32c over its copy, the finiteness check, the copy into the pages (before: a write
tensor by bytes_to_kv, then unpack_kv; now: one row copy from the received bytes), and the
pread out of a region; now also the preadv of a region straight into the pages, and the inline
plane's one pass (decode_svc.inline_landing: the copy into the pages with the CRC and the
finiteness check over each block just written, in place of the three rows above it). Steps a
path does not have show as "-".
"""

from __future__ import annotations

import argparse
import time

import google_crc32c
import numpy as np
import torch

from common.handoff.codec import (bytes_to_kv, chunk_wire, encode_chunk, kv_buffers,
                                  parse_chunk_fast)
from common.handoff.crc import payload_crc32c
from common.handoff.layout import KvLayout
from common.handoff.page_pieces import cache_bytes, kv_pieces
from common.handoff.shm_region import RegionReader, RegionWriter
from common.kernels.pack_kv import (pack_kv_cpu, pack_kv_reference, unpack_kv_bytes_cpu,
                                    unpack_kv_reference)
from common.kvpool.kv_cache import KvPool, PoolConfig
from decode_svc.finite_bits import all_finite_bytes
from decode_svc.inline_landing import land_payload

PAGE = 16


def random_host_pool(layout: KvLayout, max_tokens: int) -> KvPool:
    """A host pool of layout's shape for max_tokens, every layer's K and V random normal."""
    pool = KvPool(PoolConfig(pool_tokens=max_tokens, page_size=PAGE), layout.num_layers,
                  layout.num_kv_heads, layout.head_dim, layout.dtype, torch.device("cpu"))
    for cache in (pool.k, pool.v):
        for layer in range(layout.num_layers):
            cache[layer].normal_()
    return pool


def _per_chunk(reps: int, fn) -> float:
    """Seconds per call of fn(i), i = 0..reps-1, after one warm-up call."""
    fn(0)
    started = time.perf_counter()
    for i in range(reps):
        fn(i)
    return (time.perf_counter() - started) / reps


def steps(layout: KvLayout, pool: KvPool, tokens: int, reps: int, shm_dir: str) -> list:
    """-> [(step, seconds before or None, seconds now or None)] for chunks of `tokens` tokens."""
    layers = layout.num_layers
    table = torch.arange(0, tokens // PAGE, dtype=torch.int32)  # [pages]
    np_table = table.numpy()
    kv = pack_kv_reference(pool.k[0], pool.v[0], table, 0, tokens)  # [2, n, Hkv, D]
    k, v = kv_buffers(kv)
    frame = chunk_wire("r", 0, 0, 0, kv, b"n" * 16)
    wire = parse_chunk_fast(frame).chunk
    wire_k, wire_v = wire.k, wire.v  # read-only views of the received frame
    out = torch.empty_like(kv)
    rows = [
        ("prefill pack out of the pages", lambda i: pack_kv_reference(
            pool.k[i % layers], pool.v[i % layers], table, 0, tokens).cpu(),
         lambda i: pack_kv_cpu(pool.k[i % layers], pool.v[i % layers], table, 0, out)),
        ("prefill crc32c of K+V", lambda i: google_crc32c.extend(google_crc32c.value(k), v),
         lambda i: payload_crc32c(k, v)),
        ("prefill inline frame (copy + crc)", lambda i: encode_chunk(
            "r", i, 0, 0, tokens, k, v, google_crc32c.extend(google_crc32c.value(k), v)),
         lambda i: chunk_wire("r", i, 0, 0, kv, b"n" * 16)),
        ("decode crc32c over its copy",
         lambda i: google_crc32c.extend(google_crc32c.value(wire_k), wire_v),
         lambda i: payload_crc32c(wire_k, wire_v)),
        ("decode finiteness check", lambda i: bool(torch.isfinite(kv).all()),
         lambda i: all_finite_bytes(wire_k, layout.dtype) and all_finite_bytes(wire_v,
                                                                               layout.dtype)),
        ("decode bytes_to_kv (write tensor)", lambda i: bytes_to_kv(layout, wire_k, wire_v,
                                                                    tokens), None),
        ("decode copy into its pages", lambda i: unpack_kv_reference(
            kv, pool.k[i % layers], pool.v[i % layers], table, 0),
         lambda i: unpack_kv_bytes_cpu(wire_k, wire_v, pool.k[i % layers], pool.v[i % layers],
                                       np_table, 0, tokens)),
    ]
    pieces = kv_pieces(cache_bytes(pool.k[0]), cache_bytes(pool.v[0]),
                       layout.kv_bytes_per_token_per_layer, np_table, PAGE, 0, tokens)
    direct = {  # this stop's version of a row, where it changed
        "prefill pack out of the pages": lambda i: kv_pieces(
            cache_bytes(pool.k[i % layers]), cache_bytes(pool.v[i % layers]),
            layout.kv_bytes_per_token_per_layer, np_table, PAGE, 0, tokens),
        "prefill inline frame (copy + crc)": lambda i: chunk_wire("r", i, 0, 0, pieces,
                                                                  b"n" * 16),
    }
    result = [(name, before and _per_chunk(reps, before), now and _per_chunk(reps, now),
               _per_chunk(reps, direct[name]) if name in direct else now and _per_chunk(reps, now))
              for name, before, now in rows]
    size = 2 * len(k)
    writer = RegionWriter(shm_dir, reps * size + size)
    try:
        pwrite = _per_chunk(reps, lambda i: (writer.write(i * size, k),
                                             writer.write(i * size + len(k), v)))
        pwritev = _per_chunk(reps, lambda i: (writer.write(i * size, pieces.k),
                                              writer.write(i * size + len(k), pieces.v)))
        reader = RegionReader(shm_dir, writer.name)
        own = np.empty((2, len(k)), np.uint8)  # decode's own buffer
        pread = _per_chunk(reps, lambda i: (reader.read_into(i * size, own[0]),
                                            reader.read_into(i * size + len(k), own[1])))
        landing = [kv_pieces(cache_bytes(pool.k[layer]), cache_bytes(pool.v[layer]),
                             layout.kv_bytes_per_token_per_layer, np_table, PAGE, 0, tokens)
                   for layer in range(layers)]
        scatter = _per_chunk(reps, lambda i: (
            reader.scatter_into(i * size, landing[i % layers].k.pieces),
            reader.scatter_into(i * size + len(k), landing[i % layers].v.pieces)))
        reader.close()
    finally:
        writer.close()
    landing_k = kv_pieces(cache_bytes(pool.k[0]), cache_bytes(pool.v[0]),  # a reservation's
                          layout.k_bytes_per_token_per_layer, np_table, PAGE, 0, tokens)
    one_pass = _per_chunk(reps, lambda i: land_payload(wire_k, wire_v, landing_k.k, landing_k.v,
                                                       layout.dtype))
    return result + [("decode inline: copy+crc+finite, 1 pass", None, None, one_pass),
                     ("prefill pwrite K+V into the region", pwrite, pwrite, pwritev),
                     ("decode preadv K+V into its buffer", pread, pread, None),
                     ("decode preadv K+V into its pages", None, None, scatter)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=32, help="timed chunks per step")
    p.add_argument("--chunk-mib", default="1,4", help="chunk sizes (K plus V), MiB")
    p.add_argument("--shm-dir", default="/dev/shm")
    args = p.parse_args()
    torch.set_num_threads(1)
    layout = KvLayout(32, 8, 128, torch.bfloat16)
    sizes = [int(s) for s in args.chunk_mib.split(",")]
    pool = random_host_pool(layout, max(sizes) * (1 << 20) // layout.kv_bytes_per_token_per_layer)
    for mib in sizes:
        tokens = mib * (1 << 20) // layout.kv_bytes_per_token_per_layer
        size = tokens * layout.kv_bytes_per_token_per_layer
        print(f"chunk {mib} MiB ({tokens} tokens of one layer), ms per chunk (GB/s)")
        totals = [0.0, 0.0, 0.0]
        print(f"  {'step':38s} {'before':>15}  {'stop 11':>15}  {'now':>15}")
        for name, *columns in steps(layout, pool, tokens, args.chunks, args.shm_dir):
            cells = []
            for j, sec in enumerate(columns):
                cells.append(f"{sec * 1e3:7.3f} ({size / sec / 1e9:5.2f})" if sec else
                             f"{'-':>15}")
                totals[j] += sec or 0.0
            print(f"  {name:38s} {cells[0]}  {cells[1]}  {cells[2]}")
        print(f"  {'sum (each step once, not a pipeline)':38s} {totals[0] * 1e3:7.3f}"
              f"{'':8s}  {totals[1] * 1e3:7.3f}{'':8s}  {totals[2] * 1e3:7.3f}")


if __name__ == "__main__":
    main()
