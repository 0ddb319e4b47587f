"""The NIXL rows of `kvhandoff bench transfer`: the services' handoff over the NIXL plane (decode
READs each chunk straight from prefill's KV pages into its own, SPEC P-68, checks CRC-32C and
finiteness in one pass, verifies) and bare NIXL (the same bytes, decode-side READs in 4 MiB
pieces, crc32c checked on decode's copy), interleaved per repeat, after the other transports of
the same run. `python -m bench.transfer_nixl` runs these rows alone, and can add, interleaved in
the same repeats, "nixl-two-pass" (the verifier's CRC pass, then the engine's finiteness pass),
"nixl-staging" (READs into a staging buffer, then the engine's writes: the GPU pool's path, and
every pool's before issue 24) and "nixl-packed" (prefill packs each handoff into a registered
buffer of its own, P-66: a second synthetic prefill with the page source off; the fallback path,
and every handoff's before P-68) and "nixl-chunk<N>M" (the pages path with handoffs asking for
chunks of at most N MiB instead of the default 4 MiB: fewer frames, READs and checks per GB).

The pages row pays the P-68a scrub (prefill_svc.page_scrub: the synthetic pool does not poison
freed pages, so each handoff's slots past layer 0 are zeroed before the registration; the
synthetic model writes nothing, so those layers then travel as zeros: the same bytes and CRC
work as random KV).

Rows: "nixl" (ratio against "bare-nixl") and "bare-nixl" (ratio against raw TCP of the same
run; nan when run alone). UCX is confined to loopback (UCX_NET_DEVICES=lo, UCX_TLS=sm,tcp,self)
unless the caller's environment sets those variables. Where NIXL does not start, no row is
added and the reason is printed.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket
import sys
import time
import uuid

import numpy as np

from bench.bare_nixl import ANSWER, serve_in_process
from bench.cpu_clock import CpuMeter
from bench.synthetic_prefill import FINGERPRINT, PAGE_SIZE, SIZE_HEADER, VOCAB, SyntheticSpec
from common.handoff.binding import new_nonce, prompt_digest
from common.handoff.crc import crc32c_extend
from common.handoff.layout import DEFAULT_MAX_CHUNK_BYTES, KvLayout, protocol_version
from common.handoff.nixl_agent import DONE, IN_FLIGHT, LOOPBACK_UCX, NixlAgent, open_agent
from common.handoff.transfer import TransferRecord
from common.handoff.verifier import Expectation
from common.pb.kvhandoff.v1 import handoff_pb2
from common.sampling import SamplingConfig
from decode_svc.kv_receiver import HandoffJob
from decode_svc.nixl_receiver import NixlReceiver

PIECE = 4 << 20


async def _handoff(side, receiver: NixlReceiver, layout: KvLayout, tokens: int,
                   max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> tuple[float, int]:
    """One verified NIXL handoff written into decode's pool, in chunks of at most
    max_chunk_bytes (K plus V) -> (seconds, payload bytes)."""
    request_id = uuid.uuid4().hex
    barrier = f"{request_id}-barrier"
    await side._reserve(request_id, tokens)
    request = handoff_pb2.PrefillRequest(
        request_id=request_id, token_ids=[1] * tokens, protocol_version=protocol_version(),
        nonce=new_nonce(), model_fingerprint=FINGERPRINT, sampling=SamplingConfig().to_proto(),
        max_chunk_bytes=max_chunk_bytes)
    expect = Expectation(request_id, tokens, layout, FINGERPRINT, max_chunk_bytes,
                         VOCAB, request.nonce, prompt_digest(request.token_ids))
    try:
        started = time.perf_counter()
        landed = await receiver.receive(HandoffJob(request, expect, SamplingConfig(), 600.0),
                                        TransferRecord(request_id, "nixl"))
        await side._reserve(barrier, 1)  # commands run in order: every write is done now
        return time.perf_counter() - started, landed.payload_bytes
    finally:
        side.engine.release(request_id)
        side.engine.release(barrier)


async def bare_read(agent: NixlAgent, sock: socket.socket, size: int, own: np.ndarray,
                    peers: dict[bytes, str]) -> float:
    """Ask for size bytes, READ them in PIECE-byte pieces into own, check their crc32c."""
    started = time.perf_counter()
    sock.sendall(SIZE_HEADER.pack(size))
    meta_len, address, crc = ANSWER.unpack(_recv_exact(sock, ANSWER.size))
    meta = _recv_exact(sock, meta_len)
    if meta not in peers:
        peers[meta] = agent.add_remote(meta)
    pieces = [(address + at, min(PIECE, size - at)) for at in range(0, size, PIECE)]
    handle, state = agent.read(own[:size], pieces, peers[meta])
    while state == IN_FLIGHT:
        await asyncio.sleep(0)
        state = agent.state(handle)
    agent.release(handle)
    if state != DONE or crc32c_extend(0, own[:size]) != crc:
        raise RuntimeError(f"bare NIXL READ ended {state} or its crc32c differs")
    sock.sendall(b"\1")
    return time.perf_counter() - started


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        part = sock.recv(size - len(data))
        if not part:
            raise ConnectionError("the bare NIXL sender closed early")
        data += part
    return bytes(data)


async def _measure(layout, sizes, repeats, grpc_port, bare_port, progress, results, stats,
                   default_repeats, prefill_pid, two_pass=False, staging=False, packed=None,
                   chunk_mib=0):
    """packed: (grpc port, pid) of the packed-path prefill, for the "nixl-packed" row;
    chunk_mib: also the "nixl-chunk<N>M" row (the same receiver, chunks of N MiB)."""
    from bench.transfer_services import DecodeSide
    from decode_svc.prefill_client import PrefillClient

    meter = CpuMeter(prefill_pid)
    meters = {}

    agent, why = open_agent("bench-decode")
    if agent is None:
        return why
    side = DecodeSide(layout, max(-(-s // layout.kv_bytes_per_token) for s in sizes),
                      f"127.0.0.1:{grpc_port}", DEFAULT_MAX_CHUNK_BYTES)
    side.start()
    receiver = NixlReceiver(side.client, side.engine, agent, read_timeout_s=60.0)
    receivers = {"nixl": receiver}
    chunk_bytes = {}  # row -> max_chunk_bytes where not the default
    if chunk_mib:
        name = f"nixl-chunk{chunk_mib}M"
        receivers[name], chunk_bytes[name] = receiver, chunk_mib << 20
    if two_pass:  # the same pages, the verifier's CRC pass then the engine's finiteness pass
        receivers["nixl-two-pass"] = NixlReceiver(side.client, side.engine, agent,
                                                  read_timeout_s=60.0, one_pass=False)
    if staging:  # the path before READs landed in the pages (a GPU pool's path)
        receivers["nixl-staging"] = NixlReceiver(side.client, side.engine, agent,
                                                 read_timeout_s=60.0, into_pages=False)
    if packed is not None:  # the same decode, against the prefill that packs
        client = PrefillClient(f"127.0.0.1:{packed[0]}", DEFAULT_MAX_CHUNK_BYTES, None)
        receivers["nixl-packed"] = NixlReceiver(client, side.engine, agent, read_timeout_s=60.0)
        meters["nixl-packed"] = CpuMeter(packed[1])
    sock = socket.create_connection(("127.0.0.1", bare_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    own = np.empty(max(sizes) + layout.kv_bytes_per_token, dtype=np.uint8)  # decode's buffer
    agent.register(own, share=False)
    peers: dict[bytes, str] = {}
    try:
        for result in results:
            nbytes, tokens = result["size_bytes"], result["tokens"]
            reps = repeats or default_repeats(nbytes)
            names = [*receivers, "bare-nixl"]
            times: dict[str, list[float]] = {name: [] for name in names}
            cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
            for rep in range(reps + 1):  # the first of each is a warm-up
                for name, each in receivers.items():
                    clock = meters.get(name, meter)
                    before = clock.cpu()
                    seconds, got = await _handoff(side, each, layout, tokens,
                                                  chunk_bytes.get(name, DEFAULT_MAX_CHUNK_BYTES))
                    if got != nbytes:
                        raise RuntimeError(f"{name} moved {got} bytes, expected {nbytes}")
                    if rep:
                        times[name].append(seconds)
                        cpu[name].append(clock.since(before))
                before = meter.cpu()
                bare = await bare_read(agent, sock, nbytes, own, peers)
                if rep:
                    times["bare-nixl"].append(bare)
                    cpu["bare-nixl"].append(meter.since(before))
                progress(f"{nbytes >> 20} MiB over NIXL: {rep}/{reps}")
            rows = {name: stats(nbytes, t, cpu[name]) for name, t in times.items()}
            tcp = next((t["gbps_median"] for t in result["transports"]
                        if t["transport"] == "tcp"), float("nan"))
            bare_gbps = rows["bare-nixl"]["gbps_median"]
            for name, base, base_gbps in ([(n, "bare-nixl", bare_gbps) for n in receivers]
                                          + [("bare-nixl", "tcp", tcp)]):
                row = rows[name]
                result["transports"].append({
                    "transport": name, "baseline": base, "ratio": row["gbps_median"] / base_gbps,
                    "ratio_vs_tcp": row["gbps_median"] / tcp, **row})
    finally:
        sock.close()
        await side.close()
    return ""


def _serve_packed(spec: SyntheticSpec, conn) -> None:
    """The synthetic prefill with its NIXL handoffs packed (the page source off, P-66)."""
    from prefill_svc.servicer import HandoffServicer

    HandoffServicer._nixl_source = lambda self: False  # this spawned helper only
    serve_in_process(spec, conn)


def _start_helper(ctx, target, spec: SyntheticSpec):
    parent, child = ctx.Pipe()
    helper = ctx.Process(target=target, args=(spec, child), daemon=True)
    helper.start()
    if not parent.poll(300):
        raise RuntimeError("the NIXL synthetic prefill did not start within 300 s")
    return helper, parent, parent.recv()


def _stop_helper(helper, parent) -> None:
    parent.send("stop")
    helper.join(30)
    if helper.is_alive():
        helper.kill()


def add_nixl_rows(layout: KvLayout, sizes: list[int], repeats: int, results: list[dict],
                  torch_threads: int, progress, two_pass: bool = False,
                  staging: bool = False, packed: bool = False, chunk_mib: int = 0) -> None:
    """Appends the "nixl" and "bare-nixl" rows to each size's transports (see the module);
    two_pass: also "nixl-two-pass" (the checks in two passes, as before the one-pass check);
    staging: also "nixl-staging" (READs into a staging buffer, then the engine's writes);
    packed: also "nixl-packed" (prefill packs into a registered buffer: P-66); chunk_mib: also
    "nixl-chunk<N>M" (chunks of at most N MiB instead of the default 4 MiB)."""
    from bench.transfer import _stats, default_repeats
    from common.server.grpc_server import run_async

    for key, value in LOOPBACK_UCX.items():
        os.environ.setdefault(key, value)
    pool_tokens = max(r["tokens"] for r in results)
    # twice the largest handoff: the page lease's default cap is half the pool (P-68)
    pool_tokens = 2 * -(-pool_tokens // PAGE_SIZE) * PAGE_SIZE
    spec = SyntheticSpec(layout, pool_tokens, torch_threads)
    ctx = multiprocessing.get_context("spawn")
    helper, parent, answer = _start_helper(ctx, serve_in_process, spec)
    second = None
    try:
        if isinstance(answer, str):
            print(f"[transfer] no NIXL rows: {answer}", file=sys.stderr)
            return
        other = None
        if packed:
            second = _start_helper(ctx, _serve_packed, spec)
            other = (second[2][0], second[0].pid)
        why = run_async(lambda: _measure(layout, [r["size_bytes"] for r in results], repeats,
                                         *answer, progress, results, _stats, default_repeats,
                                         helper.pid, two_pass, staging, other, chunk_mib))
        if why:
            print(f"[transfer] no NIXL rows: {why}", file=sys.stderr)
    finally:
        _stop_helper(helper, parent)
        if second is not None:
            _stop_helper(second[0], second[1])


def main(argv: list[str]) -> int:
    """The NIXL rows alone, interleaved per repeat: python -m bench.transfer_nixl
    --sizes 64MiB,1GiB [--two-pass] [--staging] [--packed] [--chunk-mib N]."""
    import argparse

    import torch

    from bench.transfer import parse_size

    p = argparse.ArgumentParser(prog="python -m bench.transfer_nixl",
                                description="NIXL vs bare NIXL, the rows of bench transfer")
    p.add_argument("--sizes", default="64MiB,1GiB", help="KV payload sizes, comma separated")
    p.add_argument("--repeats", type=int, default=0, help="timed runs per size (0: by size)")
    p.add_argument("--two-pass", action="store_true", help="add the nixl-two-pass row")
    p.add_argument("--staging", action="store_true", help="add the nixl-staging row")
    p.add_argument("--packed", action="store_true",
                   help="add the nixl-packed row (prefill packs into a buffer: P-66)")
    p.add_argument("--chunk-mib", type=int, default=0,
                   help="add a row whose handoffs ask for chunks of at most N MiB (K plus V)")
    args = p.parse_args(argv)
    layout = KvLayout(32, 8, 128, torch.bfloat16)  # bench transfer's default (8B-shaped)
    results = [{"size_bytes": size, "tokens": size // layout.kv_bytes_per_token,
                "transports": []} for size in map(parse_size, args.sizes.split(","))]
    add_nixl_rows(layout, [r["size_bytes"] for r in results], args.repeats, results, 1,
                  lambda _: None, args.two_pass, args.staging, args.packed, args.chunk_mib)
    print(f"{'size':>9} {'row':>14} {'GB/s median':>12} {'ratio':>6} {'vs':>10} "
          f"{'CPU s/GB decode':>16} {'prefill':>8}")
    for r in results:
        for t in r["transports"]:
            print(f"{r['size_bytes'] >> 20:>5} MiB {t['transport']:>14} {t['gbps_median']:>12.3f} "
                  f"{t['ratio']:>6.2f} {t['baseline']:>10} {t['cpu_s_per_gb_decode']:>16.2f} "
                  f"{t['cpu_s_per_gb_prefill']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
