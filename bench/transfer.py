"""`kvhandoff bench transfer`: KV handoff throughput through the services' own code, against a
plain TCP socket moving the same bytes on the same machine.

    kvhandoff bench transfer [--sizes 1MiB,64MiB,1GiB] [--repeats N] [--json OUT]

Prefill runs in a spawned process (bench/synthetic_prefill.py: the real engine, codec,
servicer and gRPC server over a pool of random KV, with a forward pass that computes nothing).
This process is decode: a real `PrefillClient`, `receive_handoff` (verifier, crc32c, chunk
decode) and `DecodeEngine` writing every chunk into its own pool. One handoff is timed from the
Prefill call to the last chunk written into decode's pool. The socket baseline is timed from
the request to the last byte received. GB/s is 1e9 bytes per second of KV payload.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import multiprocessing
import os
import re
import socket
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

from bench.synthetic_prefill import (FINGERPRINT, PAGE_SIZE, SIZE_HEADER, VOCAB, PoolOnlyModel,
                                     SyntheticSpec, serve_in_process)
from common.handoff.binding import new_nonce, prompt_digest
from common.counters import Counters
from common.handoff.layout import DEFAULT_MAX_CHUNK_BYTES, KvLayout, protocol_version
from common.handoff.verifier import Expectation
from common.kvpool.kv_cache import KvPool, PoolConfig
from common.log import make_logger
from common.pb.kvhandoff.v1 import handoff_pb2
from common.sampling import SamplingConfig
from common.server.grpc_server import run_async
from decode_svc.engine import DecodeEngine
from bench.synthetic_prefill import SHM_PIECE
from common.handoff.planes import DEFAULT_SHM_DIR, INLINE, SHARED_MEMORY
from common.handoff.shm_region import RegionReader
from common.handoff.transfer import TransferRecord
from decode_svc.handoff import receive_handoff
from decode_svc.kv_receiver import HandoffJob
from decode_svc.shm_receiver import SharedMemoryReceiver
from decode_svc.prefill_client import PrefillClient

UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30,
         "KB": 10**3, "MB": 10**6, "GB": 10**9}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_size(text: str) -> int:
    """'1MiB', '64MiB', '1GiB', '500MB', '4096' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in UNITS:
        raise ValueError(f"size {text!r}: use a number with B, KiB, MiB, GiB, KB, MB or GB")
    return int(float(match.group(1)) * UNITS[unit])


class DecodeSide:
    """Decode's half of a handoff: reservation, the real receive path, the engine's writes."""

    def __init__(self, layout: KvLayout, pool_tokens: int, address: str) -> None:
        self.layout = layout
        pages = -(-pool_tokens // PAGE_SIZE) + 1  # one spare page for the barrier
        self.pool = KvPool(PoolConfig(pool_tokens=pages * PAGE_SIZE, page_size=PAGE_SIZE),
                           layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype,
                           torch.device("cpu"))
        self.engine = DecodeEngine(PoolOnlyModel(layout), self.pool, max_batch=1, max_waiting=4,
                                   log=make_logger("decode", stream=io.StringIO()),
                                   counters=Counters())
        self.client = PrefillClient(address, DEFAULT_MAX_CHUNK_BYTES, None)
        self.shm = SharedMemoryReceiver(self.client, self.engine, DEFAULT_SHM_DIR)

    async def _reserve(self, request_id: str, num_tokens: int) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self.engine.reserve(request_id, num_tokens,
                            lambda result: loop.call_soon_threadsafe(done.set_result, result))
        result = await asyncio.wait_for(done, 60.0)
        if not isinstance(result, list):
            raise RuntimeError(f"reservation refused: {result}")

    async def handoff(self, num_tokens: int, plane: str = INLINE) -> tuple[float, int]:
        """-> (seconds, payload bytes) of one verified handoff written into the pool."""
        request_id = uuid.uuid4().hex
        barrier = f"{request_id}-barrier"
        await self._reserve(request_id, num_tokens)
        request = handoff_pb2.PrefillRequest(
            request_id=request_id, token_ids=[1] * num_tokens,
            protocol_version=protocol_version(), nonce=new_nonce(),
            model_fingerprint=FINGERPRINT, sampling=SamplingConfig().to_proto(),
            max_chunk_bytes=DEFAULT_MAX_CHUNK_BYTES)
        expect = Expectation(request_id, num_tokens, self.layout, FINGERPRINT,
                             DEFAULT_MAX_CHUNK_BYTES, VOCAB, request.nonce,
                             prompt_digest(request.token_ids))
        try:
            started = time.perf_counter()
            if plane == SHARED_MEMORY:
                landed = await self.shm.receive(
                    HandoffJob(request, expect, SamplingConfig(), 600.0),
                    TransferRecord(request_id, plane))
            else:
                landed = await receive_handoff(self.client, self.engine, request, expect, 600.0)
            nbytes = landed.payload_bytes
            await self._reserve(barrier, 1)  # commands run in order: every write is done now
            return time.perf_counter() - started, nbytes
        finally:
            self.engine.release(request_id)
            self.engine.release(barrier)


def socket_receive(sock: socket.socket, size: int, buffer: bytearray) -> float:
    started = time.perf_counter()
    sock.sendall(SIZE_HEADER.pack(size))
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:size])
        if n == 0:
            raise ConnectionError("the socket sender closed early")
        got += n
    return time.perf_counter() - started


def shm_receive(sock: socket.socket, size: int, buffer: bytearray) -> float:
    """The bare shared-memory transport: ask for size bytes, pread each announced piece into
    buffer (decode's own memory) as soon as it is written."""
    started = time.perf_counter()
    sock.sendall(SIZE_HEADER.pack(size))
    view = memoryview(buffer)
    reader = None
    try:
        while True:
            name, offset, n = SHM_PIECE.unpack(_recv_all(sock, SHM_PIECE.size))
            if n == 0:
                break
            if reader is None:
                reader = RegionReader(DEFAULT_SHM_DIR, "kvh-" + name.decode())
            reader.read_into(offset, view[offset:offset + n])
        return time.perf_counter() - started
    finally:
        if reader is not None:
            reader.close()
        sock.sendall(b"\x01")


def _recv_all(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        part = sock.recv(size - len(data))
        if not part:
            raise ConnectionError("the shared-memory sender closed early")
        data += part
    return bytes(data)


def default_repeats(size: int) -> int:
    return max(2, min(30, (256 << 20) // max(size, 1)))


def _stats(nbytes: int, seconds: list[float]) -> dict:
    """GB/s of the fastest, median and slowest run."""
    return {"gbps_min": nbytes / max(seconds) / 1e9, "gbps_median":
            nbytes / statistics.median(seconds) / 1e9, "gbps_max": nbytes / min(seconds) / 1e9,
            "seconds": seconds}


async def measure(layout: KvLayout, sizes: list[int], repeats: int, grpc_port: int,
                  socket_port: int, progress, shm_port: int = 0) -> list[dict]:
    """Per size, interleaved in each repeat: the services' inline handoff, their shared-memory
    handoff, raw TCP and bare shared memory moving the same bytes."""
    per_token = layout.kv_bytes_per_token
    side = DecodeSide(layout, max(-(-s // per_token) for s in sizes), f"127.0.0.1:{grpc_port}")
    side.engine.start()
    sock = socket.create_connection(("127.0.0.1", socket_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    shm_sock = socket.create_connection(("127.0.0.1", shm_port)) if shm_port else None
    results = []
    try:
        for size in sizes:
            tokens = -(-size // per_token)
            nbytes = tokens * per_token
            reps = repeats or default_repeats(nbytes)
            buffer = bytearray(nbytes)
            times: dict[str, list[float]] = {"inline": [], "shared-memory": [], "tcp": [],
                                             "bare-shared-memory": []}
            for rep in range(reps + 1):  # the first of each is a warm-up
                runs = {"inline": await side.handoff(tokens, INLINE),
                        "tcp": (socket_receive(sock, nbytes, buffer), nbytes)}
                if shm_sock is not None:
                    runs["shared-memory"] = await side.handoff(tokens, SHARED_MEMORY)
                    runs["bare-shared-memory"] = (shm_receive(shm_sock, nbytes, buffer), nbytes)
                for name, (seconds, got) in runs.items():
                    if got != nbytes:
                        raise RuntimeError(f"{name} moved {got} bytes, expected {nbytes}")
                    if rep:
                        times[name].append(seconds)
                progress(f"{_human(nbytes)}: {rep}/{reps}")
            rows = {name: _stats(nbytes, t) for name, t in times.items() if t}
            handoff_gbps = rows["inline"]["gbps_median"]
            socket_gbps = rows["tcp"]["gbps_median"]
            results.append({
                "size_bytes": nbytes, "tokens": tokens, "repeats": reps,
                "chunks": layout.num_layers * -(-tokens // layout.chunk_tokens(
                    DEFAULT_MAX_CHUNK_BYTES)),
                "handoff_gbps": handoff_gbps, "socket_gbps": socket_gbps,
                "ratio": handoff_gbps / socket_gbps,
                "handoff_seconds": times["inline"], "socket_seconds": times["tcp"],
                "transports": _transport_rows(rows)})
    finally:
        sock.close()
        if shm_sock is not None:
            shm_sock.close()
        side.engine.stop()
        await side.client.close()
    return results


BASELINE = {"inline": "tcp", "shared-memory": "bare-shared-memory", "tcp": "tcp",
            "bare-shared-memory": "tcp"}


def _transport_rows(rows: dict[str, dict]) -> list[dict]:
    """One row per transport; ratio: median GB/s over the median of its bare baseline (the
    services' planes against their bare transport, the bare ones against raw TCP)."""
    out = []
    for name, row in rows.items():
        base = rows.get(BASELINE[name])
        ratio = row["gbps_median"] / base["gbps_median"] if base else float("nan")
        out.append({"transport": name, "baseline": BASELINE[name], "ratio": ratio,
                    "ratio_vs_tcp": row["gbps_median"] / rows["tcp"]["gbps_median"], **row})
    return out


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"



def print_table(layout: KvLayout, results: list[dict]) -> None:
    print(f"KV layout: {layout.num_layers} layers x {layout.num_kv_heads} kv heads x "
          f"{layout.head_dim} x {str(layout.dtype).removeprefix('torch.')} "
          f"({layout.kv_bytes_per_token >> 10} KiB per token); chunks of at most "
          f"{layout.chunk_tokens(DEFAULT_MAX_CHUNK_BYTES)} tokens per layer")
    print(f"{'size':>10} {'transport':>19} {'GB/s min':>9} {'median':>7} {'max':>7} "
          f"{'ratio':>6} {'vs':>19} {'vs tcp':>7}")
    for r in results:
        for t in r["transports"]:
            print(f"{_human(r['size_bytes']):>10} {t['transport']:>19} {t['gbps_min']:>9.3f} "
                  f"{t['gbps_median']:>7.3f} {t['gbps_max']:>7.3f} {t['ratio']:>6.2f} "
                  f"{t['baseline']:>19} {t['ratio_vs_tcp']:>7.2f}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvhandoff bench transfer",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default="1MiB,64MiB,1GiB", help="KV payload sizes, comma separated")
    p.add_argument("--repeats", type=int, default=0, help="timed runs per size (0: by size)")
    p.add_argument("--layers", type=int, default=32, help="layers of the KV layout")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads of the layout")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension of the layout")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="KV element type")
    p.add_argument("--torch-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="torch threads in each of the two processes (0: torch's default)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as err:
        p.error(str(err))
    layout = KvLayout(args.layers, args.kv_heads, args.head_dim, DTYPES[args.dtype])
    pool_tokens = max(-(-s // layout.kv_bytes_per_token) for s in sizes)
    pool_tokens = -(-pool_tokens // PAGE_SIZE) * PAGE_SIZE
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    spec = SyntheticSpec(layout, pool_tokens, args.torch_threads)
    helper = ctx.Process(target=serve_in_process, args=(spec, child), daemon=True)
    helper.start()
    try:
        if not parent.poll(300):
            raise RuntimeError("the synthetic prefill did not start within 300 s")
        grpc_port, socket_port, shm_port = parent.recv()

        def progress(text: str) -> None:
            print(f"\r[transfer] {text}   ", end="", file=sys.stderr, flush=True)

        results = run_async(lambda: measure(layout, sizes, args.repeats, grpc_port,
                                            socket_port, progress, shm_port))
        from bench.transfer_nixl import add_nixl_rows  # the NIXL plane's rows, its own process
        add_nixl_rows(layout, sizes, args.repeats, results, args.torch_threads, progress)
        print(file=sys.stderr)
    finally:
        parent.send("stop")
        helper.join(30)
        if helper.is_alive():
            helper.kill()
    print_table(layout, results)
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "transfer", "torch_threads": args.torch_threads, "layout": {
                "num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
                "head_dim": layout.head_dim, "dtype": args.dtype},
            "results": results}, indent=2))
    return 0
