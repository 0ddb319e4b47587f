"""`kvhandoff bench prefill`: prefill throughput of one long prompt, chunked vs unchunked, side
by side.

    kvhandoff bench prefill [--prompt-len 4096] [--chunks 0,256,1024] [--repeats 3] [--json OUT]

The real PrefillEngine on the services' model and pool (`build_service_runtime`), without gRPC: one
prompt of --prompt-len tokens is submitted, and the time runs from submit to its commit frame
(every layer's KV packed into frames on the way, as a service does). --chunks lists the
--prefill-chunk-tokens values to compare; 0 is unchunked (the whole prompt in one pass). The
settings take turns within each repeat, so drift in the machine's load hits them alike. On
CUDA the peak of device memory allocated during the run (above the pool and weights) is
reported too: the activation memory chunking bounds.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import threading
import time
from pathlib import Path

import torch

from common.config import ServiceConfig
from common.counters import Counters
from common.handoff.layout import DEFAULT_MAX_CHUNK_BYTES
from common.log import make_logger
from common.sampling import SamplingConfig
from common.server.core_borrowing import CoreBorrowing
from common.server.runtime import build_service_runtime, warm_up
from common.server.torch_threads import in_passing_thread
from prefill_svc.engine import PrefillEngine, PrefillJob
from prefill_svc.send_budget import SendBudget


def run_once(runtime, chunk: int, prompt: list[int], max_batch_tokens: int, tag: str) -> dict:
    """One prompt through a fresh engine with that chunk (0: the whole prompt) -> timings."""
    n = len(prompt)
    chunk_tokens = chunk or n
    engine = PrefillEngine(runtime.model, runtime.pool, runtime.layout,
                           max(max_batch_tokens, chunk_tokens),
                           make_logger("prefill", stream=io.StringIO()), Counters(),
                           SendBudget(1 << 40), prefill_chunk_tokens=chunk_tokens,
                           cores=CoreBorrowing(runtime.cores))
    ended = threading.Event()
    frames = [0]
    job: PrefillJob

    def emit(frame: bytes | None) -> None:
        if frame is None:
            ended.set()
            return
        frames[0] += 1
        engine.frame_sent(job, len(frame))

    job = PrefillJob(tag, prompt, SamplingConfig(),
                     runtime.layout.chunk_tokens(DEFAULT_MAX_CHUNK_BYTES), emit)
    device = runtime.model.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    engine.start()
    started = time.perf_counter()
    engine.submit(job)
    if not ended.wait(timeout=3600):
        raise RuntimeError("the prefill did not finish")
    seconds = time.perf_counter() - started
    engine.stop()
    if job.chunks_sent != frames[0] - 1 or job.computed_tokens != n:
        raise RuntimeError(f"the prefill did not complete: {job.computed_tokens} of {n} tokens")
    row = {"seconds": seconds, "passes": engine.counters.get("forward_passes")}
    if device.type == "cuda":
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
    return row


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvhandoff bench prefill",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=4096, help="tokens of the prompt")
    p.add_argument("--chunks", default="0,256,1024",
                   help="--prefill-chunk-tokens values, comma separated; 0: unchunked")
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="the pass budget")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each setting")
    p.add_argument("--model", default="demo", help="'demo' or a checkpoint directory")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--kernels", default="auto", help="auto, triton, cpu or torch")
    p.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    p.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
    n = args.prompt_len
    config = ServiceConfig(model=args.model, device=args.device, kernels=args.kernels,
                           dtype=args.dtype, pool_tokens=n + 64, max_context_tokens=n,
                           allow_context_beyond_pool=True, torch_threads=args.torch_threads)
    # as the services start: the engine thread's torch team is the process's only one
    runtime = build_service_runtime(config, make_logger("prefill", stream=io.StringIO()),
                                    max_pass_tokens=args.max_batch_tokens)
    in_passing_thread(warm_up, runtime)
    vocab = runtime.loaded.config.vocab_size
    prompt = [(7 * t + 3) % (vocab - 3) + 3 for t in range(n)]
    for chunk in chunks:  # warm-up: first-use costs (kernel compiles, allocator) off the clock
        run_once(runtime, chunk, prompt[: min(n, 2 * (chunk or 64))], args.max_batch_tokens,
                 f"warm-{chunk}")
    samples: dict[int, list[dict]] = {c: [] for c in chunks}
    for repeat in range(args.repeats):
        for chunk in chunks:
            samples[chunk].append(run_once(runtime, chunk, prompt, args.max_batch_tokens,
                                           f"r{repeat}-{chunk}"))
    rows = []
    for chunk in chunks:
        secs = [s["seconds"] for s in samples[chunk]]
        row = {"chunk": chunk, "passes": samples[chunk][0]["passes"], "min_s": min(secs),
               "median_s": statistics.median(secs), "max_s": max(secs),
               "tokens_per_s": n / statistics.median(secs)}
        if "peak_bytes" in samples[chunk][0]:
            row["peak_bytes"] = max(s["peak_bytes"] for s in samples[chunk])
        rows.append(row)
    base = rows[0]["tokens_per_s"]
    print(f"model {args.model} on {runtime.model.device} ({runtime.kernels} kernels, "
          f"{str(runtime.model.dtype).removeprefix('torch.')}, {runtime.cores.own_threads} torch "
          f"threads); one prompt of {n} tokens, {args.repeats} runs each, taking turns")
    print(f"{'chunk':>7} {'passes':>6} {'min s':>8} {'median s':>9} {'max s':>8} "
          f"{'tokens/s':>9} {'vs ' + _name(chunks[0]):>10}" + ("   peak MiB" if "peak_bytes"
                                                               in rows[0] else ""))
    for r in rows:
        line = (f"{_name(r['chunk']):>7} {r['passes']:>6} {r['min_s']:>8.3f} "
                f"{r['median_s']:>9.3f} {r['max_s']:>8.3f} {r['tokens_per_s']:>9.0f} "
                f"{r['tokens_per_s'] / base:>9.2f}x")
        if "peak_bytes" in r:
            line += f" {r['peak_bytes'] / 2**20:>10.1f}"
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "chunked_prefill", "model": args.model,
                                         "device": str(runtime.model.device),
                                         "kernels": runtime.kernels, "prompt_len": n,
                                         "rows": rows}, indent=2))
    return 0


def _name(chunk: int) -> str:
    return "whole" if chunk == 0 else str(chunk)
