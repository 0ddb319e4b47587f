"""What a small handoff pays on the shared-memory plane beyond its bytes, part by part: the whole
handoff through the services' code (decode's receive path against the synthetic prefill of
`bench transfer`, no model) at 128 and 512 tokens of the demo model's and the 8-layer bench
checkpoint's layouts, beside each part timed alone in this process.

    PYTHONPATH=. python bench/transfer_fixed_cost.py [--tokens 128,512] [--repeats 30]

Parts: prefill's region create + unlink; a handoff's region written fresh (tmpfs pages
allocated and zeroed) vs taken from the region pool (common.handoff.region_pool) vs a bare
write into a region written before; decode's open + checks + close +
unlink; a ReleaseHandoff round trip (gRPC unary, loopback); the verifier's setup; decode's
per-chunk work on the reference frames (parse, landing, checks, verifier); the reservation's
round trip through decode's engine thread. The content checks (layer-0 recompute, depth check)
need the model: `kvhandoff bench ttft --compare-checks` measures them (decode's log, paired
TTFTs). Medians; parts and handoffs alternate within each repeat.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
import uuid

import numpy as np
import torch

from bench.synthetic_prefill import FINGERPRINT, PAGE_SIZE, VOCAB, SyntheticSpec, serve_in_process
from bench.transfer_services import DecodeSide
from common.handoff.binding import new_nonce, prompt_digest
from common.handoff.layout import DEFAULT_MAX_CHUNK_BYTES, KvLayout
from common.handoff.planes import DEFAULT_SHM_DIR, SHARED_MEMORY
from common.handoff.region_pool import RegionPool
from common.handoff.shm_region import RegionReader, RegionWriter
from common.handoff.verifier import Expectation, HandoffVerifier
from common.server.grpc_server import run_async

LAYOUTS = {"demo": KvLayout(4, 2, 64, torch.float32),  # common/model/demo.py
           "bench-8-layer": KvLayout(8, 4, 64, torch.float32)}  # bench/make_bench_checkpoint


def _sync_ms(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e3


def _interleaved_ms(fns: dict, repeats: int) -> dict[str, float]:
    """Median ms of each fn, the fns called in turn, repeat after repeat (same load for all)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - started)
    return {name: statistics.median(ts) * 1e3 for name, ts in samples.items()}


async def _async_ms(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e3


def _region_parts(size: int, repeats: int) -> dict[str, float]:
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    pool = RegionPool()
    reused = RegionWriter(DEFAULT_SHM_DIR, size)
    try:
        reused.write(0, data)

        def fresh_write():
            region = RegionWriter(DEFAULT_SHM_DIR, size)
            region.write(0, data)
            region.close()

        def pooled_write():
            region = RegionWriter(DEFAULT_SHM_DIR, size, pool)
            region.write(0, data)
            region.close(recycle=True)

        def open_read_side():
            reader = RegionReader(DEFAULT_SHM_DIR, reused.name)
            reader.close()

        return _interleaved_ms({
            "prefill: region create + unlink": lambda: RegionWriter(DEFAULT_SHM_DIR,
                                                                    size).close(),
            "prefill: create + write + unlink, fresh region": fresh_write,
            "prefill: take + write + unlink, pooled region": pooled_write,
            "prefill: write into a region written before": lambda: reused.write(0, data),
            "decode: region open + checks + close": open_read_side}, repeats)
    finally:
        reused.close()
        pool.close()


def _verifier_setup_ms(layout: KvLayout, tokens: int, repeats: int) -> float:
    expect = Expectation("r", tokens, layout, FINGERPRINT, DEFAULT_MAX_CHUNK_BYTES, VOCAB,
                         b"n" * 16, prompt_digest([1] * tokens))
    return _sync_ms(lambda: HandoffVerifier(expect), repeats)


async def _measure(side: DecodeSide, layout: KvLayout, tokens: int, repeats: int) -> dict:
    size = tokens * layout.kv_bytes_per_token
    row = {"tokens": tokens, "payload_bytes": size,
           "chunks": layout.num_layers * -(-tokens // layout.chunk_tokens(
               DEFAULT_MAX_CHUNK_BYTES))}
    for plane in ("inline", SHARED_MEMORY):
        await side.handoff(tokens, plane)  # warm-up
    handoffs: dict[str, list[float]] = {"inline": [], SHARED_MEMORY: []}
    for _ in range(repeats):
        for plane in handoffs:
            seconds, _ = await side.handoff(tokens, plane)
            handoffs[plane].append(seconds)
    row["handoff_ms"] = {p: statistics.median(s) * 1e3 for p, s in handoffs.items()}
    parts = _region_parts(size, repeats)
    parts["decode: verifier setup"] = _verifier_setup_ms(layout, tokens, repeats)
    parts["ReleaseHandoff round trip (loopback gRPC)"] = await _async_ms(
        lambda: side.client.release(uuid.uuid4().hex, new_nonce(), 5.0), repeats)
    parts["decode: reservation round trip (engine thread)"] = await _async_ms(
        lambda: _reserve_release(side, tokens), repeats)
    row["parts_ms"] = parts
    return row


async def _reserve_release(side: DecodeSide, tokens: int) -> None:
    request_id = uuid.uuid4().hex
    await side._reserve(request_id, tokens)
    side.engine.release(request_id)


def _run_layout(name: str, layout: KvLayout, token_counts: list[int], repeats: int) -> list:
    pool_tokens = -(-max(token_counts) // PAGE_SIZE) * PAGE_SIZE + PAGE_SIZE
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    helper = ctx.Process(target=serve_in_process, args=(SyntheticSpec(layout, pool_tokens, 1),
                                                        child), daemon=True)
    helper.start()
    try:
        if not parent.poll(300):
            raise RuntimeError("the synthetic prefill did not start within 300 s")
        grpc_port, _, _ = parent.recv()

        async def go():
            side = DecodeSide(layout, pool_tokens, f"127.0.0.1:{grpc_port}",
                              DEFAULT_MAX_CHUNK_BYTES)
            side.start()
            try:
                return [await _measure(side, layout, n, repeats) for n in token_counts]
            finally:
                await side.close()

        return run_async(go)
    finally:
        parent.send("stop")
        helper.join(30)
        if helper.is_alive():
            helper.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="128,512")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    token_counts = [int(t) for t in args.tokens.split(",")]
    for name in args.layouts.split(","):
        layout = LAYOUTS[name]
        for row in _run_layout(name, layout, token_counts, args.repeats):
            print(f"{name} ({layout.num_layers} layers), {row['tokens']} tokens: "
                  f"{row['payload_bytes'] >> 10} KiB in {row['chunks']} chunks; medians of "
                  f"{args.repeats}, ms")
            for plane, ms in row["handoff_ms"].items():
                print(f"  {'whole handoff, ' + plane + ' (no model)':52s} {ms:8.3f}")
            for part, ms in row["parts_ms"].items():
                print(f"  {part:52s} {ms:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
