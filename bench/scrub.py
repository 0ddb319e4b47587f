"""`python -m bench.scrub`: what --scrub-freed-pages costs (and --poison-freed-pages, for
reference), side by side with freeing alone.

    python -m bench.scrub [--device cpu|cuda] [--request-tokens 256,2048] [--json OUT]

1. Free latency: `KvPool.release` of one request's pages, median of --repeats, on a pool shaped
   like --layers x --kv-heads x --head-dim (default: a Llama-3-8B-like layout); on CUDA the time
   includes the fill kernel (synchronized).
2. Decode throughput: the real DecodeEngine on a model (--model, default demo) generating
   --new-tokens for each of --requests requests, --concurrency at a time (the pool holds that
   many), every finished request's pages freed (and scrubbed) while the others decode. Prompt KV
   is random bytes written through the engine's own `write`, so no prefill runs.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import time
from pathlib import Path

import torch

from common.counters import Counters
from common.kvpool.kv_cache import KvPool, PoolConfig
from common.model.llama import LlamaModel
from common.model.loader import load_model
from common.ops.select import make_ops
from common.sampling import SamplingConfig
from decode_svc.engine import DecodeEngine
from decode_svc.sequence import Sequence, TokenEvent

MODES = {"plain": {}, "scrub": {"scrub_freed": True}, "poison": {"poison_freed": True}}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class _NullLog:
    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_latency_us(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    rows = []
    for tokens in args.request_tokens:
        row: dict = {"tokens": tokens, "pages": -(-tokens // args.page_size)}
        for mode, flags in MODES.items():
            pool = KvPool(PoolConfig(args.pool_tokens, args.page_size, **flags), args.layers,
                          args.kv_heads, args.head_dim, dtype, device)
            samples = []
            for i in range(args.repeats + 2):
                pool.allocator.allocate(f"r{i}", tokens)
                _sync(device)
                start = time.perf_counter()
                pool.release(f"r{i}")
                _sync(device)
                samples.append(time.perf_counter() - start)
            row[f"{mode}_us"] = statistics.median(samples[2:]) * 1e6  # first two: warm-up
            del pool
        row["scrub_ratio"] = row["scrub_us"] / row["plain_us"]
        rows.append(row)
    return rows


def decode_tokens_per_s(args, model: LlamaModel, scrub: bool) -> float:
    """All requests are reserved up front; the pool holds exactly --concurrency of them, so each
    finished request's release (and scrub) admits the next. A grant's callback queues that
    request's KV writes and its start from the engine thread itself, so no client thread races
    the engine for the interpreter."""
    c = model.config
    per_request = args.prompt_tokens + args.new_tokens - 1
    pool_tokens = args.concurrency * -(-per_request // args.page_size) * args.page_size
    pool = KvPool(PoolConfig(pool_tokens, args.page_size, scrub_freed=scrub),
                  c.num_layers, c.num_kv_heads, c.head_dim, model.dtype, model.device)
    engine = DecodeEngine(model, pool, args.concurrency, args.requests + 8, _NullLog(), Counters())
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, c.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
    kv = torch.randn(2, args.prompt_tokens, c.num_kv_heads, c.head_dim, generator=gen)
    kv = kv.to(model.dtype)
    ended: queue.Queue = queue.Queue()

    def emit(event) -> None:
        if not isinstance(event, TokenEvent):
            ended.put(event)

    def on_granted(request_id: str):
        def start(_pages) -> None:
            for layer in range(c.num_layers):
                engine.write(request_id, layer, 0, kv)
            engine.begin(Sequence(request_id, args.prompt_tokens, [*prompt, prompt[-1]],
                                  args.new_tokens, SamplingConfig(), frozenset(), emit))
        return start

    def run(names: list[str]) -> None:
        for name in names:
            engine.reserve(name, per_request, on_granted(name))
        for _ in names:
            ended.get()

    engine.start()
    try:
        run([f"warm{i}" for i in range(args.concurrency)])  # every batch size once, untimed
        _sync(model.device)
        begin = time.perf_counter()
        run([f"r{i}" for i in range(args.requests)])
        _sync(model.device)
        return args.requests * args.new_tokens / (time.perf_counter() - begin)
    finally:
        engine.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvhandoff bench scrub", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=[*DTYPES, "auto"], default="auto", help="KV element type")
    p.add_argument("--layers", type=int, default=32, help="layers of the free-latency pool")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads of the free-latency pool")
    p.add_argument("--head-dim", type=int, default=128,
                   help="head dimension of the free-latency pool")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--pool-tokens", type=int, default=4096, help="size of the free-latency pool")
    p.add_argument("--request-tokens", type=lambda s: [int(x) for x in s.split(",")],
                   default=[16, 256, 2048],
                   help="request sizes in tokens whose release is timed, comma separated")
    p.add_argument("--repeats", type=int, default=20, help="timed releases per size (median)")
    p.add_argument("--model", default="demo",
                   help="model of the decode-throughput part: 'demo' or a checkpoint")
    p.add_argument("--requests", type=int, default=128, help="requests decoded per mode")
    p.add_argument("--concurrency", type=int, default=16, help="requests decoding at a time")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens generated per request")
    p.add_argument("--rounds", type=int, default=5, help="decode runs per mode (median)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = (DTYPES[args.dtype] if args.dtype != "auto"
             else torch.bfloat16 if device.type == "cuda" else torch.float32)

    rows = free_latency_us(args, device, dtype)
    print(f"free latency, median of {args.repeats} (pool {args.pool_tokens} tokens x "
          f"{args.layers} layers x {args.kv_heads} kv heads x {args.head_dim}, "
          f"{str(dtype).removeprefix('torch.')}, {device}):")
    print(f"{'tokens':>8} {'pages':>6} {'plain us':>10} {'scrub us':>10} {'poison us':>10} "
          f"{'scrub/plain':>12}")
    for r in rows:
        print(f"{r['tokens']:>8} {r['pages']:>6} {r['plain_us']:>10.1f} {r['scrub_us']:>10.1f} "
              f"{r['poison_us']:>10.1f} {r['scrub_ratio']:>11.1f}x")

    loaded = load_model(args.model)
    model = LlamaModel(loaded.config, loaded.weights, make_ops("auto", device), device, dtype)
    runs: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(args.rounds):  # alternate the order: the machine may drift
        for scrubbed in ((False, True) if round_ % 2 == 0 else (True, False)):
            runs[scrubbed].append(decode_tokens_per_s(args, model, scrubbed))
    plain, scrub = statistics.median(runs[False]), statistics.median(runs[True])
    print(f"\ndecode throughput, median of {args.rounds} runs ({args.model}, {args.requests} "
          f"requests of {args.prompt_tokens} + {args.new_tokens} tokens, {args.concurrency} "
          f"at a time, {device}):")
    print(f"{'plain tok/s':>12} {'scrub tok/s':>12} {'scrub/plain':>12}")
    print(f"{plain:>12.1f} {scrub:>12.1f} {scrub / plain:>11.3f}x")
    print("runs, plain: " + ", ".join(f"{r:.0f}" for r in runs[False]))
    print("runs, scrub: " + ", ".join(f"{r:.0f}" for r in runs[True]))
    if args.json:
        args.json.write_text(json.dumps({
            "device": str(device), "dtype": str(dtype), "free_latency": rows,
            "decode": {"plain_tokens_per_s": plain, "scrub_tokens_per_s": scrub,
                       "ratio": scrub / plain, "runs_plain": runs[False],
                       "runs_scrub": runs[True]}}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
