"""`kvhandoff bench serve`: a serving load test in the manner of `vllm bench serve`, for the
disaggregated pair and for the same engine in one process (decode --local-prefill), side by side.

    kvhandoff bench serve [--modes disaggregated,local | --target HOST:PORT]
        [--num-prompts 64] [--request-rate inf|R[,R...]] [--max-concurrency N[,N...]]
        [--input-len N|LOW:HIGH] [--output-len N|LOW:HIGH] [--warmup-requests 2]
        [--shared-prefix-len N] [--cache-salt SALT]
        [--slo-ttft-ms MS] [--slo-tpot-ms MS] [--json OUT] [--plot-dir DIR]

It starts the services itself (processes on 127.0.0.1, `--model`, pool and page flags shared
by every service) unless --target names a running decode. Every mode gets the same requests
(same seed) and the same loads. Prompts are random token ids; generation ignores end of
sequence so that output lengths are the ones drawn.

The shared-prefix workload: `--shared-prefix-len 1024 --input-len 32 --modes cache-off,cache-on`
gives every prompt the same 1024-token system prompt before its own 32 tokens, all under one
`--cache-salt`, and compares prefill's prefix cache off and on side by side. The warm-up
requests carry another salt, so the measured cache starts cold.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from bench.serve_client import LengthRange, make_requests, run_load, warm_up
from bench.serve_report import print_table, summarize, write_plots
from bench.servers import MODES, model_vocab_size, start_deployment
from common.server.grpc_server import run_async


def _floats(text: str) -> list[float]:
    return [math.inf if p.strip() in ("inf", "") else float(p) for p in text.split(",")]


def _ints(text: str) -> list[int]:
    return [int(p) for p in text.split(",") if p.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvhandoff bench serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help="disaggregated and/or local")
    p.add_argument("--target", default="", help="benchmark a running decode at HOST:PORT instead")
    p.add_argument("--model", default="demo", help="'demo' or a checkpoint directory")
    p.add_argument("--vocab-size", type=int, default=0, help="(with --target) token id bound")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--pool-tokens", type=int, default=65536, help="for every service")
    p.add_argument("--max-context-tokens", type=int, default=0,
                   help="context window of every service (0: the model's)")
    p.add_argument("--server-args", default="", help="extra flags for every service")
    p.add_argument("--decode-args", default="", help="extra flags for decode")
    p.add_argument("--torch-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="OMP threads per service process (0: torch's default)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per load")
    p.add_argument("--request-rate", type=_floats, default=[math.inf],
                   help="Poisson arrival rates in req/s, comma separated; inf: all at once")
    p.add_argument("--max-concurrency", type=_ints, default=[0],
                   help="caps on requests in flight, comma separated; 0: no cap")
    p.add_argument("--input-len", type=LengthRange.parse, default=LengthRange(256, 256),
                   help="prompt tokens: N, or LOW-HIGH drawn uniformly")
    p.add_argument("--output-len", type=LengthRange.parse, default=LengthRange(64, 64),
                   help="generated tokens: N, or LOW-HIGH drawn uniformly")
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="tokens of a prefix every prompt starts with (before --input-len)")
    p.add_argument("--cache-salt", default="bench",
                   help="cache_salt of every measured request (one tenant)")
    p.add_argument("--warmup-requests", type=int, default=2,
                   help="untimed requests before each mode")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths and arrivals")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="TTFT objective for goodput, in ms (none: not checked)")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="TPOT objective for goodput, in ms (none: not checked)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="deadline of each request in seconds")
    p.add_argument("--json", type=Path, help="write config, summaries and every request here")
    p.add_argument("--plot-dir", type=Path, help="write PNG plots here (needs matplotlib)")
    return p


def _load_name(rate: float, concurrency: int) -> str:
    text = f"rate {'inf' if math.isinf(rate) else f'{rate:g}'} req/s"
    return text + (f", max concurrency {concurrency}" if concurrency else "")


def _offered(rate: float, concurrency: int, summary: dict) -> float:
    if math.isfinite(rate):
        return rate
    return float(concurrency) if concurrency else summary["request_throughput"]


def _progress(label: str):
    def show(done: int, total: int) -> None:
        bar = "#" * (30 * done // total)
        print(f"\r[{label}] |{bar:<30}| {done}/{total}", end="" if done < total else "\n",
              file=sys.stderr, flush=True)
    return show



def run_mode(mode: str, address: str, args, specs, warmups, loads, results, runs) -> None:
    run_async(lambda: warm_up(address, warmups, args.request_timeout))
    for rate, concurrency in loads:
        load = _load_name(rate, concurrency)
        got, duration = run_async(lambda rate=rate, concurrency=concurrency, load=load: run_load(
            address, specs, rate, concurrency, args.seed, args.request_timeout,
            _progress(f"{mode}, {load}")))
        summary = summarize(got, duration, args.slo_ttft_ms, args.slo_tpot_ms)
        results[(mode, load)] = got
        runs.append({"mode": mode, "load": load, "request_rate": None if math.isinf(rate)
                     else rate, "max_concurrency": concurrency,
                     "offered": _offered(rate, concurrency, summary), "summary": summary})


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    modes = ["target"] if args.target else [m.strip() for m in args.modes.split(",") if m]
    unknown = set(modes) - {*MODES, "target"}
    if unknown:
        parser().error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    vocab = args.vocab_size or model_vocab_size(args.model)
    specs = make_requests(args.num_prompts, args.input_len, args.output_len, vocab, args.seed,
                          args.shared_prefix_len, args.cache_salt)
    warmups = make_requests(args.warmup_requests, args.input_len, LengthRange(4, 4), vocab,
                            args.seed + 1, args.shared_prefix_len, args.cache_salt + "-warm-up")
    loads = [(rate, c) for rate in args.request_rate for c in args.max_concurrency]
    flags = ["--model", args.model, "--page-size", str(args.page_size), "--pool-tokens",
             str(args.pool_tokens), "--max-context-tokens", str(args.max_context_tokens),
             *shlex.split(args.server_args)]
    results: dict = {}
    runs: list[dict] = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kvh-bench-serve-") as tmp:
        for mode in modes:
            if mode == "target":
                run_mode(mode, args.target, args, specs, warmups, loads, results, runs)
                continue
            print(f"[{mode}] starting services ...", file=sys.stderr, flush=True)
            deployment = start_deployment(mode, flags, Path(tmp), args.torch_threads,
                                          shlex.split(args.decode_args))
            try:
                run_mode(mode, deployment.address, args, specs, warmups, loads, results, runs)
            finally:
                deployment.stop()
    config = {"modes": modes, "model": args.model, "num_prompts": args.num_prompts,
              "shared_prefix_len": args.shared_prefix_len, "cache_salt": args.cache_salt,
              "input_len": str(args.input_len), "output_len": str(args.output_len),
              "loads": [_load_name(r, c) for r, c in loads], "slo_ttft_ms": args.slo_ttft_ms,
              "slo_tpot_ms": args.slo_tpot_ms, "torch_threads": args.torch_threads,
              "service_flags": flags, "decode_args": args.decode_args, "seed": args.seed,
              "started": started}
    shared = f"a shared prefix of {args.shared_prefix_len} and " if args.shared_prefix_len else ""
    print(f"\n{args.num_prompts} prompts, input {shared}{args.input_len} tokens, output "
          f"{args.output_len} tokens, model {args.model}, {args.torch_threads} torch threads "
          f"per service")
    for load in dict.fromkeys(_load_name(r, c) for r, c in loads):
        print_table(load, {run["mode"]: run["summary"] for run in runs if run["load"] == load})
    if args.json:
        args.json.write_text(json.dumps({
            "config": config, "runs": runs,
            "requests": {f"{mode} | {load}": [r.record() for r in got]
                         for (mode, load), got in results.items()}}, indent=1))
    if args.plot_dir:
        for path in write_plots(runs, results, args.plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if all(run["summary"]["failed"] == 0 for run in runs) else 1
