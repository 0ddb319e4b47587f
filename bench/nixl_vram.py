"""The GPU rows of the NIXL plane (issue 24 item 5), for one prepared run on a lent device
(bench/gpu_check.sh) and runnable on a CPU-only host (the DRAM row, the rest print "skipped").

READ rows: a spawned prefill process registers a source buffer with its agent (its progress
thread, prefill_svc.nixl_sender.NixlPlane, completes the READs as in the service); this process
(decode) READs it in 4 MiB pieces into a registered destination and compares a sample of bytes:
- dram->dram: host to host (today's plane, the bare baseline);
- dram->vram: prefill's host buffer straight into decode's VRAM (a decode pool on cuda: no
  staging buffer, no engine copy);
- vram->vram: GPU to GPU on one host (UCX cuda_ipc / cuda_copy).
Pack rows: a cuda pool's request pages gathered per layer and copied to the host, as prefill's
sender does for a GPU pool: `.cpu()` into pageable memory (KvSender.pack today) against a
non-blocking copy into pinned buffers on a side stream, overlapping the next layer's gather.

UCX: UCX_NET_DEVICES=lo and UCX_TLS=sm,tcp,self (plus cuda_copy,cuda_ipc with a GPU) unless the
environment sets them. Prints a table; --json writes the rows. GB/s is 1e9 bytes per second.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.cpu_clock import CpuMeter

PIECE = 4 << 20
SAMPLE_STRIDE = 1 << 16


def _ucx_env(cuda: bool) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_TLS", "sm,tcp,self" + (",cuda_copy,cuda_ipc" if cuda else ""))


def _buffer(size: int, mem: str, random: bool) -> torch.Tensor:
    device = "cuda" if mem == "VRAM" else "cpu"
    if random:
        return torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
    return torch.empty(size, dtype=torch.uint8, device=device)


def _source(conn, cuda: bool) -> None:
    """The prefill side: ("alloc", size, mem) -> (address, partial metadata, sample); "stop"."""
    _ucx_env(cuda)
    from common.handoff.nixl_agent import open_agent
    from prefill_svc.nixl_sender import NixlPlane

    agent, why = open_agent("vram-prefill")
    conn.send(why)
    if agent is None:
        return
    plane = NixlPlane(agent)
    plane.pinned(+1)
    held = []
    while (command := conn.recv()) != "stop":
        _, size, mem = command
        buf = _buffer(size, mem, True)
        reg = agent.register_memory(buf.data_ptr(), size, mem, share=True)
        held.append((buf, reg))
        plane.emitted()
        conn.send((buf.data_ptr(), reg.metadata, buf[::SAMPLE_STRIDE].cpu().numpy().tobytes()))
    plane.close()


def _read_rows(sizes: list[int], repeats: int, cuda: bool) -> list[dict]:
    _ucx_env(cuda)
    from common.handoff.nixl_agent import DONE, IN_FLIGHT, open_agent

    agent, why = open_agent("vram-decode")
    if agent is None:
        print(f"[nixl_vram] no READ rows: {why}", file=sys.stderr)
        return []
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_source, args=(child, cuda), daemon=True)
    proc.start()
    rows = []
    try:
        why = conn.recv()
        if why:
            print(f"[nixl_vram] no READ rows: {why}", file=sys.stderr)
            return []
        meter = CpuMeter(proc.pid)
        peers: dict[bytes, str] = {}
        pairs = [("DRAM", "DRAM")] + ([("DRAM", "VRAM"), ("VRAM", "VRAM")] if cuda else [])
        for src, dst in pairs:
            for size in sizes:
                conn.send(("alloc", size, src))
                address, meta, sample = conn.recv()
                if meta not in peers:
                    peers[meta] = agent.add_remote(meta)
                dest = _buffer(size, dst, False)
                reg = agent.register_memory(dest.data_ptr(), size, dst)
                spans = [(at, min(PIECE, size - at)) for at in range(0, size, PIECE)]
                local = [(dest.data_ptr() + at, n) for at, n in spans]
                remote = [(address + at, n) for at, n in spans]
                times, cpu = [], []
                for rep in range(repeats + 1):  # the first is a warm-up
                    before, started = meter.cpu(), time.perf_counter()
                    handle, state = agent.read_pieces(local, remote, peers[meta], dst, src)
                    while state == IN_FLIGHT:
                        state = agent.state(handle)
                    agent.release(handle)
                    if state != DONE:
                        raise RuntimeError(f"{src}->{dst} READ ended {state}")
                    if rep:
                        times.append(time.perf_counter() - started)
                        cpu.append(sum(meter.since(before)))
                if dest[::SAMPLE_STRIDE].cpu().numpy().tobytes() != sample:
                    raise RuntimeError(f"{src}->{dst}: the landed bytes differ from the source")
                agent.deregister(reg)
                rows.append(_row(f"{src.lower()}->{dst.lower()}", size, times, cpu))
    finally:
        conn.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return rows


def _pack_pageable(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, pinned, side) -> None:
    """Today's KvSender.pack for a GPU pool: gather, then .cpu() into pageable memory."""
    for layer in range(k.shape[0]):
        torch.stack((k[layer][table], v[layer][table])).cpu()  # [2, n, S, Hkv, D]


def _pack_side_stream(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                      pinned: torch.Tensor, side) -> None:
    """Gather on the compute stream, copy to pinned host memory on a side stream."""
    main = torch.cuda.current_stream()
    for layer in range(k.shape[0]):
        gathered = torch.stack((k[layer][table], v[layer][table]))  # [2, n, S, Hkv, D]
        side.wait_stream(main)
        with torch.cuda.stream(side):
            pinned[layer].copy_(gathered, non_blocking=True)
        gathered.record_stream(side)
    side.synchronize()


def _pack_rows(sizes: list[int], repeats: int) -> list[dict]:
    """Pageable .cpu() vs pinned side-stream copies of a request's pages, layer by layer."""
    layers, heads, dim, page = 32, 8, 128, 16
    row = 2 * heads * dim * 2  # K and V bytes per token per layer (bf16)
    rows = []
    for size in sizes:
        pages = max(1, size // (layers * row * page))
        # k, v: [L, P, S, Hkv, D] on the GPU, twice the pages the request holds
        k = torch.randn(layers, 2 * pages, page, heads, dim, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        table = torch.randperm(2 * pages, device="cuda")[:pages]  # a shuffled page table
        pinned = torch.empty(layers, 2, pages, page, heads, dim, dtype=torch.bfloat16,
                             pin_memory=True)  # [L, 2, n, S, Hkv, D]
        side = torch.cuda.Stream()
        nbytes = pinned.numel() * pinned.element_size()
        for name, run in (("pack pageable", _pack_pageable),
                          ("pack pinned side-stream", _pack_side_stream)):
            times, cpu = [], []
            for rep in range(repeats + 1):
                torch.cuda.synchronize()
                before, started = time.process_time(), time.perf_counter()
                run(k, v, table, pinned, side)
                torch.cuda.synchronize()
                if rep:
                    times.append(time.perf_counter() - started)
                    cpu.append(time.process_time() - before)
            rows.append(_row(name, nbytes, times, cpu))
    return rows


def _row(name: str, size: int, times: list[float], cpu: list[float]) -> dict:
    median = statistics.median(times)
    return {"row": name, "size_bytes": size, "gbps_median": size / median / 1e9,
            "gbps_max": size / min(times) / 1e9,
            "cpu_s_per_gb": statistics.median(cpu) / size * 1e9}  # READ rows: both processes


def main(argv: list[str]) -> int:
    from bench.transfer import parse_size

    p = argparse.ArgumentParser(prog="python -m bench.nixl_vram",
                                description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="64MiB,1GiB", help="bytes per READ, comma separated")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row and size")
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    cuda = torch.cuda.is_available()
    rows = _read_rows(sizes, args.repeats, cuda)
    if cuda:
        rows += _pack_rows(sizes, args.repeats)
    else:
        print("[nixl_vram] no GPU: the dram->vram, vram->vram and pack rows are skipped",
              file=sys.stderr)
    print(f"{'row':>24} {'size':>9} {'GB/s median':>12} {'max':>7} {'CPU s/GB':>9}")
    for r in rows:
        print(f"{r['row']:>24} {r['size_bytes'] >> 20:>5} MiB {r['gbps_median']:>12.3f} "
              f"{r['gbps_max']:>7.3f} {r['cpu_s_per_gb']:>9.3f}")
    if args.json:
        args.json.write_text(json.dumps({"cuda": cuda, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
