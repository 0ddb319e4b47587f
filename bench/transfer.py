"""`kvhandoff bench transfer`: KV handoff throughput through the services' own code on each data
plane, side by side with the bare transports moving the same bytes on the same machine.

    kvhandoff bench transfer [--sizes 64MiB,1GiB] [--repeats N] [--json OUT]

Prefill runs in a spawned process (bench/synthetic_prefill.py: the real engine, codec,
servicer and gRPC server over a pool of random KV, with a forward pass that computes nothing),
which also serves the bare transports. This process is decode (bench/transfer_services.py:
the real receive path and `DecodeEngine` writing every chunk into its own pool;
bench/transfer_bare.py: the bare clients). Rows, interleaved in every repeat:

    inline          services, KV in the gRPC frames     baseline: bare-grpc
    shared-memory   services, references to a region    baseline: bare-shared-memory
    tcp             raw socket                          baseline: itself
    bare-grpc       grpc.aio stream of 4 MiB messages   baseline: tcp
    bare-shared-memory  region + announced pieces       baseline: tcp
    inline-3pass    (--inline-3pass) inline through the engine's write path, the old decode side

`ratio` is the row's median GB/s over its baseline's median in the same run; `ratio_vs_tcp`
too. Another plane adds its rows through `extra_transports` (a module bench/transfer_<plane>.py
with `transports(context) -> list[Transport]`). GB/s is 1e9 bytes of KV payload per second.
Each row also has the CPU seconds per GB each process spent (bench/cpu_clock.py), medians.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import socket
import statistics
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.cpu_clock import CpuMeter
from bench.synthetic_prefill import PAGE_SIZE, SyntheticSpec, serve_in_process
from bench.transfer_bare import BareGrpc, shm_receive, socket_receive
from bench.transfer_services import INLINE_3PASS, TWO_PASS, DecodeSide
from common.handoff.layout import DEFAULT_MAX_CHUNK_BYTES, KvLayout
from common.handoff.planes import SHARED_MEMORY
from common.malloc_tuning import keep_freed_heap
from common.server.grpc_server import run_async

UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30,
         "KB": 10**3, "MB": 10**6, "GB": 10**9}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Transport:
    """One row: run(nbytes) moves nbytes once -> (seconds, bytes moved)."""

    name: str
    baseline: str
    run: Callable[[int], Awaitable[tuple[float, int]]]


def parse_size(text: str) -> int:
    """'1MiB', '64MiB', '1GiB', '500MB', '4096' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in UNITS:
        raise ValueError(f"size {text!r}: use a number with B, KiB, MiB, GiB, KB, MB or GB")
    return int(float(match.group(1)) * UNITS[unit])


def _stats(nbytes: int, seconds: list[float], cpu: list[tuple[float, float]] | None = None
           ) -> dict:
    """GB/s of the slowest, median and fastest run; with cpu ((decode, prefill) CPU seconds of
    each run), the median CPU seconds per GB of each process."""
    row = {"gbps_min": nbytes / max(seconds) / 1e9, "gbps_median":
           nbytes / statistics.median(seconds) / 1e9, "gbps_max": nbytes / min(seconds) / 1e9,
           "seconds": seconds}
    if cpu:
        row["cpu_s_per_gb_decode"] = statistics.median(d for d, _ in cpu) / (nbytes / 1e9)
        row["cpu_s_per_gb_prefill"] = statistics.median(p for _, p in cpu) / (nbytes / 1e9)
    return row


async def timed(meter: CpuMeter, run, nbytes: int) -> tuple[float, int, tuple[float, float]]:
    """run(nbytes) -> (seconds, bytes, (decode, prefill) CPU seconds it used)."""
    before = meter.cpu()
    seconds, got = await run(nbytes)
    return seconds, got, meter.since(before)


def default_repeats(size: int) -> int:
    return max(3, min(30, (256 << 20) // max(size, 1)))


async def measure(layout: KvLayout, sizes: list[int], repeats: int, ports: dict,
                  max_chunk_bytes: int, progress, shm_two_pass: bool = False,
                  only: frozenset[str] = frozenset(), inline_3pass: bool = False
                  ) -> list[dict]:
    """only: the rows to run (their baselines always run too); empty: every row."""
    per_token = layout.kv_bytes_per_token
    meter = CpuMeter(ports["pid"])
    side = DecodeSide(layout, max(-(-s // per_token) for s in sizes),
                      f"127.0.0.1:{ports['grpc']}", max_chunk_bytes)
    side.start()
    sock = socket.create_connection(("127.0.0.1", ports["tcp"]))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    shm_sock = socket.create_connection(("127.0.0.1", ports["shm"]))
    bare_grpc = BareGrpc(f"127.0.0.1:{ports['grpc']}")
    results = []
    try:
        for size in sizes:
            tokens = -(-size // per_token)
            nbytes = tokens * per_token
            buffer = bytearray(nbytes)
            transports = _builtin(side, sock, shm_sock, bare_grpc, tokens, buffer)
            if shm_two_pass:
                transports.insert(2, Transport("shared-memory-2pass", "bare-shared-memory",
                                               lambda n, t=tokens: side.handoff(t, TWO_PASS)))
            if inline_3pass:
                transports.insert(1, Transport(INLINE_3PASS, "bare-grpc",
                                               lambda n, t=tokens: side.handoff(t, INLINE_3PASS)))
            if only:
                keep = only | {t.baseline for t in transports if t.name in only} | {"tcp"}
                transports = [t for t in transports if t.name in keep]
            reps = repeats or default_repeats(nbytes)
            times: dict[str, list[float]] = {t.name: [] for t in transports}
            cpu: dict[str, list[tuple[float, float]]] = {t.name: [] for t in transports}
            for rep in range(reps + 1):  # the first round is a warm-up
                for t in transports:
                    seconds, got, used = await timed(meter, t.run, nbytes)
                    if got != nbytes:
                        raise RuntimeError(f"{t.name} moved {got} bytes, expected {nbytes}")
                    if rep:
                        times[t.name].append(seconds)
                        cpu[t.name].append(used)
                progress(f"{_human(nbytes)}: {rep}/{reps}")
            rows = {name: _stats(nbytes, t, cpu[name]) for name, t in times.items()}
            results.append({
                "size_bytes": nbytes, "tokens": tokens, "repeats": reps,
                "chunk_tokens": layout.chunk_tokens(max_chunk_bytes),
                "chunks": layout.num_layers * -(-tokens // layout.chunk_tokens(max_chunk_bytes)),
                "transports": _transport_rows(rows, {t.name: t.baseline for t in transports})})
    finally:
        sock.close()
        shm_sock.close()
        await bare_grpc.close()
        await side.close()
    return results


def _builtin(side: DecodeSide, sock: socket.socket, shm_sock: socket.socket,
             bare_grpc: BareGrpc, tokens: int, buffer: bytearray) -> list[Transport]:
    return [
        Transport("inline", "bare-grpc", lambda n: side.handoff(tokens, "inline")),
        Transport("shared-memory", "bare-shared-memory",
                  lambda n: side.handoff(tokens, SHARED_MEMORY)),
        Transport("tcp", "tcp", lambda n: _sync(socket_receive(sock, n, buffer))),
        Transport("bare-grpc", "tcp", bare_grpc.receive),
        Transport("bare-shared-memory", "tcp", lambda n: _sync(shm_receive(shm_sock, n, buffer)))]


async def _sync(result: tuple[float, int]) -> tuple[float, int]:
    return result


def _transport_rows(rows: dict[str, dict], baselines: dict[str, str]) -> list[dict]:
    """One row per transport; ratio: its median GB/s over its baseline's median."""
    out = []
    for name, row in rows.items():
        base = rows[baselines[name]]
        out.append({"transport": name, "baseline": baselines[name],
                    "ratio": row["gbps_median"] / base["gbps_median"],
                    "ratio_vs_tcp": row["gbps_median"] / rows["tcp"]["gbps_median"], **row})
    return out


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def print_table(layout: KvLayout, results: list[dict], max_chunk_bytes: int) -> None:
    print(f"KV layout: {layout.num_layers} layers x {layout.num_kv_heads} kv heads x "
          f"{layout.head_dim} x {str(layout.dtype).removeprefix('torch.')} "
          f"({layout.kv_bytes_per_token >> 10} KiB per token); chunks of at most "
          f"{layout.chunk_tokens(max_chunk_bytes)} tokens per layer")
    print(f"{'size':>10} {'transport':>19} {'GB/s min':>9} {'median':>7} {'max':>7} "
          f"{'ratio':>6} {'vs':>19} {'vs tcp':>7} {'CPU s/GB decode':>16} {'prefill':>8}")
    for r in results:
        for t in r["transports"]:
            cpu = (f"{t['cpu_s_per_gb_decode']:>16.2f} {t['cpu_s_per_gb_prefill']:>8.2f}"
                   if "cpu_s_per_gb_decode" in t else "")
            print(f"{_human(r['size_bytes']):>10} {t['transport']:>19} {t['gbps_min']:>9.3f} "
                  f"{t['gbps_median']:>7.3f} {t['gbps_max']:>7.3f} {t['ratio']:>6.2f} "
                  f"{t['baseline']:>19} {t['ratio_vs_tcp']:>7.2f} {cpu}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvhandoff bench transfer",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default="64MiB,1GiB", help="KV payload sizes, comma separated")
    p.add_argument("--repeats", type=int, default=0, help="timed runs per size (0: by size)")
    p.add_argument("--layers", type=int, default=32, help="layers of the KV layout")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads of the layout")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension of the layout")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="KV element type")
    p.add_argument("--max-chunk-bytes", type=parse_size, default=DEFAULT_MAX_CHUNK_BYTES,
                   help="the max_chunk_bytes decode asks for (chunk size)")
    p.add_argument("--torch-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="torch threads in each of the two processes (0: torch's default)")
    p.add_argument("--no-malloc-tuning", action="store_true",
                   help="keep glibc's malloc defaults (common/malloc_tuning.py) in both processes")
    p.add_argument("--shm-two-pass", action="store_true",
                   help="add a shared-memory row with the CRC and finiteness as two passes "
                   "(before decode_svc.payload_pass), side by side with the one pass")
    p.add_argument("--inline-3pass", action="store_true",
                   help="add an inline row with the engine's write path (the verifier's CRC, "
                   "then the finiteness check and the copy on the engine thread), side by side "
                   "with the one pass into the pages")
    p.add_argument("--no-nixl", action="store_true", help="skip the NIXL plane's rows")
    p.add_argument("--only", default="", help="comma-separated rows to run (with their "
                   "baselines and tcp), e.g. inline,bare-grpc; empty: all")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    tuned = not args.no_malloc_tuning and keep_freed_heap()
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as err:
        p.error(str(err))
    only = frozenset(s.strip() for s in args.only.split(",") if s.strip())
    layout = KvLayout(args.layers, args.kv_heads, args.head_dim, DTYPES[args.dtype])
    pool_tokens = max(-(-s // layout.kv_bytes_per_token) for s in sizes)
    pool_tokens = -(-pool_tokens // PAGE_SIZE) * PAGE_SIZE
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    spec = SyntheticSpec(layout, pool_tokens, args.torch_threads, tuned)
    helper = ctx.Process(target=serve_in_process, args=(spec, child), daemon=True)
    helper.start()
    try:
        if not parent.poll(300):
            raise RuntimeError("the synthetic prefill did not start within 300 s")
        grpc_port, socket_port, shm_port = parent.recv()
        ports = {"grpc": grpc_port, "tcp": socket_port, "shm": shm_port, "pid": helper.pid}

        def progress(text: str) -> None:
            print(f"\r[transfer] {text}   ", end="", file=sys.stderr, flush=True)

        results = run_async(lambda: measure(layout, sizes, args.repeats, ports,
                                            args.max_chunk_bytes, progress,
                                            args.shm_two_pass, only, args.inline_3pass))
        if not args.no_nixl:
            from bench.transfer_nixl import add_nixl_rows  # the NIXL plane's rows, own process
            add_nixl_rows(layout, sizes, args.repeats, results, args.torch_threads, progress)
        print(file=sys.stderr)
    finally:
        parent.send("stop")
        helper.join(30)
        if helper.is_alive():
            helper.kill()
    print_table(layout, results, args.max_chunk_bytes)
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "transfer", "torch_threads": args.torch_threads,
            "malloc_tuning": tuned, "max_chunk_bytes": args.max_chunk_bytes, "layout": {
                "num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
                "head_dim": layout.head_dim, "dtype": args.dtype},
            "results": results}, indent=2))
    return 0
