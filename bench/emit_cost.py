"""Prefill's emission of one handoff, sender by sender, in this process: the engine's
`_emit_layer` loop (spans -> pack -> chunk for every layer) over a paged CPU pool whose pages
are shuffled, then the sender's release, as the engine and the servicer call them (no model, no
gRPC). CPU per handoff, medians; the senders alternate within each repeat.

    PYTHONPATH=. python bench/emit_cost.py [--layout demo] [--tokens 512] [--repeats 60]
                 [--baseline-tree DIR]

With --baseline-tree DIR (another checkout: the tree before a change) the same rows also run
from DIR in a child process, alternating with this tree's, so a change is measured A/B on the
same load. The shared-memory sender takes its region files from a region pool and releases them
as decode's ReleaseHandoff does (recycled), so every handoff after the first reuses a file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LAYOUTS = {"demo": (4, 2, 64, torch.float32),  # common/model/demo.py
           "bench8": (8, 8, 64, torch.bfloat16)}  # bench/make_bench_checkpoint.py
PAGE_SIZE = 16


def _rows(tree: Path, layout: str, tokens: int, repeats: int) -> dict[str, dict[str, float]]:
    """{sender: {part: median CPU ms per handoff}} measured with tree's modules."""
    sys.path.insert(0, str(tree))
    from common.handoff.layout import DEFAULT_MAX_CHUNK_BYTES, KvLayout
    from common.handoff.region_pool import RegionPool
    from prefill_svc.kv_sender import InlineSender
    from prefill_svc.shm_sender import SharedMemorySender

    torch.set_num_threads(1)  # as the services run it here (--torch-threads 1)
    num_layers, heads, dim, dtype = LAYOUTS[layout]
    kv_layout = KvLayout(num_layers, heads, dim, dtype)
    pages_needed = -(-tokens // PAGE_SIZE)
    num_pages = 2 * pages_needed + 8
    k = torch.randn(num_layers, num_pages, PAGE_SIZE, heads, dim).to(dtype)  # [L, P, S, Hkv, D]
    v = torch.randn(num_layers, num_pages, PAGE_SIZE, heads, dim).to(dtype)
    table = torch.tensor(random.Random(7).sample(range(num_pages), pages_needed),
                         dtype=torch.int32)  # [pages] shuffled: the runs are one page each
    chunk_tokens = kv_layout.chunk_tokens(DEFAULT_MAX_CHUNK_BYTES)
    shm_dir = tempfile.mkdtemp(prefix="kvh-emit-", dir="/dev/shm")
    regions = RegionPool()
    makers = {"inline": lambda rid: InlineSender(rid),
              "shared-memory": lambda rid: SharedMemorySender(rid, kv_layout, tokens, shm_dir,
                                                              regions)}
    out: dict[str, dict[str, list[float]]] = {n: {"pack": [], "chunk": [], "release": []}
                                              for n in makers}
    nonce = os.urandom(16)
    try:
        for i in range(repeats + 3):
            for name, make in makers.items():
                sender = make(f"req-{i}-{name}")
                pack = chunk = 0.0
                seq = 0
                for layer in range(num_layers):
                    for start, count in sender.spans(table, 0, tokens, chunk_tokens):
                        t0 = time.thread_time()
                        kv = sender.pack(None, k[layer], v[layer], table, start, count)
                        t1 = time.thread_time()
                        frame = sender.chunk(sender.record.request_id, seq, layer, start, kv,
                                             nonce)
                        t2 = time.thread_time()
                        assert frame is not None
                        pack, chunk, seq = pack + t1 - t0, chunk + t2 - t1, seq + 1
                t3 = time.thread_time()
                if sender.pins_bytes:
                    sender.release(True, peer_done=True)
                else:
                    sender.release(True)
                release = time.thread_time() - t3
                if i >= 3:  # warm-up: the region pool's first files, caches
                    for part, ms in (("pack", pack), ("chunk", chunk), ("release", release)):
                        out[name][part].append(ms * 1e3)
    finally:
        regions.close()
        os.rmdir(shm_dir)
    return {name: {part: statistics.median(ms) for part, ms in parts.items()}
            for name, parts in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="demo")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3, help="A/B alternations with --baseline-tree")
    p.add_argument("--baseline-tree", type=Path)
    p.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)  # child mode
    args = p.parse_args(argv)
    here = Path(__file__).resolve().parents[1]
    if args.rows_only:  # run by main with cwd = the tree to measure
        print(json.dumps(_rows(Path.cwd(), args.layout, args.tokens, args.repeats)))
        return 0
    trees = {"this tree": here}
    if args.baseline_tree:
        trees["base"] = args.baseline_tree.resolve()
    results: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.rounds if args.baseline_tree else 1):
        for name, tree in trees.items():
            child = [sys.executable, str(Path(__file__).resolve()), "--rows-only",
                     "--layout", args.layout, "--tokens", str(args.tokens),
                     "--repeats", str(args.repeats)]
            env = {**os.environ, "PYTHONPATH": str(tree)}
            done = subprocess.run(child, cwd=tree, env=env, capture_output=True, text=True,
                                  check=True)
            results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"layout {args.layout}, {args.tokens} tokens, CPU ms per handoff (medians of "
          f"{args.repeats}; the median of {len(results['this tree'])} round(s))")
    for name, rounds in results.items():
        for sender in rounds[0]:
            parts = {part: statistics.median(r[sender][part] for r in rounds)
                     for part in rounds[0][sender]}
            total = sum(parts.values())
            print(f"  {name:10s} {sender:14s} total {total:6.3f}  " +
                  "  ".join(f"{part} {ms:6.3f}" for part, ms in parts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
