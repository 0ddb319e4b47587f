"""Where a handoff's time goes, step by step, per 1 MiB chunk (256 tokens of a Llama-3-8B-shaped
layer, K plus V in bf16), in one process on one torch thread.

    PYTHONPATH=. python bench/transfer_breakdown.py [--chunks 64] [--shm-dir /dev/shm]

Steps: prefill's pack_kv out of the pages, crc32c, the inline frame, the write into a
shared-memory region; decode's pread into its own buffer, crc32c over its copy, the copy into
the write tensor, and the engine's unpack_kv into its pages.
"""

from __future__ import annotations

import argparse
import time

import google_crc32c
import torch

from common.handoff.codec import bytes_to_kv, chunk_wire, kv_buffers
from common.handoff.layout import KvLayout
from common.handoff.shm_region import RegionReader, RegionWriter
from common.kvpool.kv_cache import KvPool, PoolConfig
from common.ops.torch_ops import TorchOps

TOKENS = 256


def _timed(label: str, chunk_bytes: int, reps: int, fn) -> None:
    started = time.perf_counter()
    for i in range(reps):
        fn(i)
    per = (time.perf_counter() - started) / reps
    print(f"{label:38s} {per * 1e3:7.3f} ms/chunk {chunk_bytes / per / 1e9:7.2f} GB/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--shm-dir", default="/dev/shm")
    args = p.parse_args()
    torch.set_num_threads(1)
    layout = KvLayout(32, 8, 128, torch.bfloat16)
    pool = KvPool(PoolConfig(pool_tokens=4096, page_size=16), 32, 8, 128, torch.bfloat16,
                  torch.device("cpu"))
    for cache in (pool.k, pool.v):
        for layer in range(32):
            cache[layer].normal_()
    ops, table = TorchOps(), torch.arange(0, TOKENS // 16, dtype=torch.int32)
    size = TOKENS * layout.kv_bytes_per_token_per_layer
    n = args.chunks
    kv = ops.pack_kv(pool.k[0], pool.v[0], table, 0, TOKENS).cpu()  # [2, 256, 8, 128]
    k, v = kv_buffers(kv)
    _timed("prefill pack_kv + .cpu()", size, n,
           lambda i: ops.pack_kv(pool.k[i % 32], pool.v[i % 32], table, 0, TOKENS).cpu())
    _timed("crc32c of K+V", size, n, lambda i: google_crc32c.extend(google_crc32c.value(k), v))
    _timed("inline chunk_wire (copy + crc)", size, n,
           lambda i: chunk_wire("r", i, 0, 0, kv, b"n" * 16))
    writer = RegionWriter(args.shm_dir, n * size)
    try:
        _timed("pwrite K+V into the region", size, n,
               lambda i: (writer.write(i * size, k), writer.write(i * size + len(k), v)))
        reader = RegionReader(args.shm_dir, writer.name)
        own = torch.empty_like(kv)
        flat = own.view(torch.uint8).view(2, -1).numpy()  # [2, bytes] decode's own memory
        _timed("decode preadv K+V into its buffer", size, n,
               lambda i: (reader.read_into(i * size, flat[0]),
                          reader.read_into(i * size + len(k), flat[1])))
        reader.close()
    finally:
        writer.close()
    _timed("decode crc32c over its copy", size, n,
           lambda i: google_crc32c.extend(google_crc32c.value(flat[0]), flat[1]))
    _timed("decode bytes_to_kv (write tensor)", size, n,
           lambda i: bytes_to_kv(layout, flat[0], flat[1], TOKENS))
    _timed("decode engine unpack_kv into pages", size, n,
           lambda i: ops.unpack_kv(own, pool.k[i % 32], pool.v[i % 32], table, 0))


if __name__ == "__main__":
    main()
