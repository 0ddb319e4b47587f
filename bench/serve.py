"""`kvhandoff bench serve`: a serving load test in the manner of `vllm bench serve`, for the
disaggregated pair and for the same engine in one process (decode --local-prefill), side by side.

    kvhandoff bench serve [--modes disaggregated,local | --target HOST:PORT
                           | --backend openai --url http://HOST:PORT/v1 [--server-pids PIDS]]
        [--variant 'NAME=PREFILL FLAGS[;DECODE FLAGS]' ...] [--rounds N]
        [--num-prompts 64] [--request-rate inf|R[,R...]] [--max-concurrency N[,N...]]
        [--input-len N|LOW:HIGH] [--output-len N|LOW:HIGH] [--warmup-requests 2]
        [--shared-prefix-len N] [--cache-salt SALT]
        [--slo-ttft-ms MS] [--slo-tpot-ms MS] [--json OUT] [--plot-dir DIR]

It starts the services itself (processes on 127.0.0.1, `--model`, pool and page flags shared
by every service) unless --target names a running decode. Every mode gets the same requests
(same seed) and the same loads; each load draws its own prompts (seed + 1000 x its index), so
that no load is served from a prefix cache the one before filled. Prompts are random token
ids; generation ignores end of sequence so that output lengths are the ones drawn.

`--backend openai --url http://127.0.0.1:8000/v1` sends the same requests (same seed, lengths,
concurrency and timing code) to any OpenAI-compatible server as streaming /v1/completions
(bench/openai_client.py), e.g. vLLM or our decode's --http-port. `--server-pids` names the
server's processes (their children are counted too) for the CPU-seconds-per-token column; the
services this command starts are counted without it. `--compare A.json B.json ...` prints the
side-by-side table of earlier runs' --json files, with each system's ratios to the last one
(`--ratio-base` to choose), so that the systems run one at a time on the same cores.

`--variant 'b1024=--max-batch-tokens 1024'` adds a disaggregated pair named b1024 whose
prefill gets those flags (after the CPU placement flags, so they may override them; decode's
follow a ';'): a setting's A/B in one run, e.g. `--modes disaggregated --variant ...`.
`--rounds 2` runs every system twice, taking turns (rows MODE#1, MODE#2), so that the drift of
a loaded host's load does not land on one side only.

The shared-prefix workload: `--shared-prefix-len 1024 --input-len 32 --modes cache-off,cache-on`
gives every prompt the same 1024-token system prompt before its own 32 tokens, all under one
`--cache-salt`, and compares prefill's prefix cache off and on side by side. The warm-up
requests carry another salt, so the measured cache starts cold.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path

from bench.server_cpu import check_pids, tree_cpu_seconds
from bench.serve_client import GrpcBackend, LengthRange, make_requests, run_load, warm_up
from bench.serve_report import print_headline, print_table, summarize, write_plots
from bench.servers import DEFAULT_MODES, MODES, Variant, model_vocab_size, start_deployment
from common.server.grpc_server import run_async


LOAD_SEED_STRIDE = 1000  # load i's prompts come from seed + 1000 i (the warm-up's: seed + 1)


def _floats(text: str) -> list[float]:
    return [math.inf if p.strip() in ("inf", "") else float(p) for p in text.split(",")]


def _variant(text: str) -> Variant:
    try:
        return Variant.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _ints(text: str) -> list[int]:
    return [int(p) for p in text.split(",") if p.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvhandoff bench serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"any of {', '.join(MODES)} (borrowing: the pair with core borrowing)")
    p.add_argument("--variant", type=_variant, action="append", default=[],
                   metavar="NAME=FLAGS[;DECODE FLAGS]",
                   help="a disaggregated pair named NAME whose prefill (and decode, after ';') "
                        "gets these flags; repeatable; runs after --modes (give --modes '' for "
                        "variants only)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the modes and variants this many times, taking turns (round r's "
                        "rows are named MODE#r), so drift in the host's load hits them alike")
    p.add_argument("--target", default="", help="benchmark a running decode at HOST:PORT instead")
    p.add_argument("--backend", default="grpc", choices=("grpc", "openai"),
                   help="grpc: our Generate API; openai: an OpenAI-compatible server at --url")
    p.add_argument("--url", default="", help="(openai) the server's base URL, ending in /v1")
    p.add_argument("--served-model", default="",
                   help="(openai) the request's model field (empty: the first of GET /models)")
    p.add_argument("--prompt-format", default="ids", choices=("ids", "text"),
                   help="(openai) prompts as token ids, or as text decoded by --model's "
                        "tokenizer.json")
    p.add_argument("--label", default="openai", help="(openai) the system's name in the tables")
    p.add_argument("--server-pids", type=_ints, default=[],
                   help="pids of a running server (--target, --url) whose CPU time, children "
                        "included, is read from /proc; comma separated")
    p.add_argument("--compare", type=Path, nargs="+", default=[], metavar="JSON",
                   help="print the side-by-side table of earlier --json runs and exit")
    p.add_argument("--ratio-base", default="",
                   help="the system the ratios are against (empty: the last one)")
    p.add_argument("--cpu-split", action=argparse.BooleanOptionalAction, default=True,
                   help="give a started prefill and decode each its own share of the CPUs, as "
                        "`kvhandoff up` does (a local-prefill decode gets all of them)")
    p.add_argument("--core-borrowing", action=argparse.BooleanOptionalAction, default=False,
                   help="with --cpu-split, each service of a pair also computes on the other's "
                        "CPUs while the other idles, as `kvhandoff up` does")
    p.add_argument("--model", default="demo", help="'demo' or a checkpoint directory")
    p.add_argument("--vocab-size", type=int, default=0, help="(with --target) token id bound")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--pool-tokens", type=int, default=65536, help="for every service")
    p.add_argument("--max-context-tokens", type=int, default=0,
                   help="context window of every service (0: the model's)")
    p.add_argument("--server-args", default="", help="extra flags for every service")
    p.add_argument("--decode-args", default="", help="extra flags for decode")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch threads per started service (0: one per CPU of its share; "
                        "with --no-cpu-split, torch's default)")
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



def point_name(input_len: str, output_len: str, load: str) -> str:
    """A row of the side-by-side table: the workload and the load."""
    return f"in {input_len}, out {output_len}, {load}"


def run_mode(mode: str, backend, pids: list[int], args, load_specs, warmups, loads, results,
             runs) -> None:
    """load_specs[i]: the requests of loads[i]."""
    run_async(lambda: warm_up(backend, warmups, args.request_timeout))
    for (rate, concurrency), specs in zip(loads, load_specs):
        load = _load_name(rate, concurrency)
        cpu_before = tree_cpu_seconds(pids) if pids else None
        got, duration = run_async(lambda rate=rate, concurrency=concurrency, load=load,
                                  specs=specs: run_load(
            backend, specs, rate, concurrency, args.seed, args.request_timeout,
            _progress(f"{mode}, {load}")))
        summary = summarize(got, duration, args.slo_ttft_ms, args.slo_tpot_ms)
        if cpu_before is not None:
            summary["server_cpu_s"] = tree_cpu_seconds(pids) - cpu_before
            summary["cpu_s_per_output_token"] = (summary["server_cpu_s"]
                                                 / max(summary["output_tokens"], 1))
        results[(mode, load)] = got
        runs.append({"mode": mode, "load": load,
                     "point": point_name(str(args.input_len), str(args.output_len), load),
                     "request_rate": None if math.isinf(rate) else rate,
                     "max_concurrency": concurrency,
                     "offered": _offered(rate, concurrency, summary), "summary": summary})


def compare(paths: list[Path], base: str) -> int:
    """The side-by-side table of earlier runs' JSON files."""
    runs = []
    for path in paths:
        try:
            data = json.loads(path.read_text())
            for run in data["runs"]:
                config = data["config"]
                runs.append({**run, "point": run.get("point") or point_name(
                    config["input_len"], config["output_len"], run["load"])})
        except (OSError, ValueError, KeyError, TypeError) as err:
            print(f"kvhandoff bench serve: --compare {path}: not a bench serve JSON file "
                  f"({type(err).__name__}: {err})", file=sys.stderr)
            return 2
    if base and base not in {run["mode"] for run in runs}:
        print(f"kvhandoff bench serve: --ratio-base {base!r} is not among the systems "
              f"{sorted({run['mode'] for run in runs})}", file=sys.stderr)
        return 2
    print_headline(runs, base or None)
    return 0


def _systems(args) -> list[str]:
    if args.backend == "openai":
        return [args.label]
    if args.target:
        return ["target"]
    return [m.strip() for m in args.modes.split(",") if m.strip()] + [v.name for v in
                                                                      args.variant]


def _openai_backend(args):
    from bench.openai_client import OpenAiBackend

    return OpenAiBackend(args.url, args.served_model, args.prompt_format,
                         "" if args.model == "demo" else args.model, args.label)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.compare:
        return compare(args.compare, args.ratio_base)
    if args.backend == "openai" and not args.url.startswith(("http://", "https://")):
        parser().error("--backend openai needs --url http://HOST:PORT/v1")
    if args.backend == "openai" and args.model == "demo" and not args.vocab_size:
        parser().error("--backend openai needs --model DIR (the server's checkpoint: its "
                       "vocabulary bounds the prompts' ids) or --vocab-size")
    modes = _systems(args)
    variants = {v.name: v for v in args.variant}
    unknown = (set(modes) - {*MODES, "target", *variants} if args.backend == "grpc"
               else set())
    if len(set(modes)) < len(modes):
        parser().error(f"a system named twice in {modes}")
    if args.rounds < 1:
        parser().error("--rounds must be >= 1")
    if unknown:
        parser().error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    try:
        check_pids(args.server_pids)
        backend = _openai_backend(args) if args.backend == "openai" else None
    except (ValueError, RuntimeError) as err:
        parser().error(str(err))
    vocab = args.vocab_size or model_vocab_size(args.model)
    loads = [(rate, c) for rate in args.request_rate for c in args.max_concurrency]
    # every load its own prompts (a server's prefix cache would serve a repeat from the last
    # load), the same ones in every mode and system
    specs = [make_requests(args.num_prompts, args.input_len, args.output_len, vocab,
                           args.seed + LOAD_SEED_STRIDE * i, args.shared_prefix_len,
                           args.cache_salt) for i in range(len(loads))]
    warmups = make_requests(args.warmup_requests, args.input_len, LengthRange(4, 4), vocab,
                            args.seed + 1, args.shared_prefix_len, args.cache_salt + "-warm-up")
    flags = ["--model", args.model, "--page-size", str(args.page_size), "--pool-tokens",
             str(args.pool_tokens), "--max-context-tokens", str(args.max_context_tokens),
             *shlex.split(args.server_args)]
    results: dict = {}
    runs: list[dict] = []
    started = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="kvh-bench-serve-") as tmp:
            for round_, mode in ((r, m) for r in range(1, args.rounds + 1) for m in modes):
                label = mode if args.rounds == 1 else f"{mode}#{round_}"
                if backend is not None or mode == "target":
                    run_mode(label, backend or GrpcBackend(args.target), args.server_pids,
                             args, specs, warmups, loads, results, runs)
                    continue
                print(f"[{label}] starting services ...", file=sys.stderr, flush=True)
                variant = variants.get(mode)
                deployment = start_deployment("disaggregated" if variant else mode, flags,
                                              Path(tmp) / label, args.torch_threads,
                                              shlex.split(args.decode_args),
                                              cpu_split=args.cpu_split, variant=variant,
                                              core_borrowing=args.core_borrowing)
                try:
                    run_mode(label, GrpcBackend(deployment.address), deployment.pids, args,
                             specs, warmups, loads, results, runs)
                finally:
                    deployment.stop()
    except RuntimeError as err:  # a warm-up that failed, a server that cannot be used
        print(f"\nkvhandoff bench serve: {err}", file=sys.stderr)
        return 1
    config = {"modes": modes, "rounds": args.rounds,
              "variants": {v.name: {"prefill": list(v.prefill_flags),
                                    "decode": list(v.decode_flags)} for v in args.variant},
              "model": args.model, "num_prompts": args.num_prompts,
              "backend": args.backend, "url": args.url,
              "shared_prefix_len": args.shared_prefix_len, "cache_salt": args.cache_salt,
              "input_len": str(args.input_len), "output_len": str(args.output_len),
              "loads": [_load_name(r, c) for r, c in loads], "slo_ttft_ms": args.slo_ttft_ms,
              "slo_tpot_ms": args.slo_tpot_ms, "torch_threads": args.torch_threads,
              "cpu_split": args.cpu_split, "core_borrowing": args.core_borrowing,
              "service_flags": flags,
              "decode_args": args.decode_args, "seed": args.seed, "started": started}
    shared = f"a shared prefix of {args.shared_prefix_len} and " if args.shared_prefix_len else ""
    placed = ("the URL's server" if args.backend == "openai" else
              f"{args.torch_threads or 'one per CPU'} torch threads per service, CPUs "
              f"{'split' if args.cpu_split else 'shared'}")
    print(f"\n{args.num_prompts} prompts, input {shared}{args.input_len} tokens, output "
          f"{args.output_len} tokens, model {args.model}, {placed}")
    for load in dict.fromkeys(_load_name(r, c) for r, c in loads):
        print_table(load, {run["mode"]: run["summary"] for run in runs if run["load"] == load})
    print_headline(runs, args.ratio_base or None)
    if args.json:
        args.json.write_text(json.dumps({
            "config": config, "runs": runs,
            "requests": {f"{mode} | {load}": [r.record() for r in got]
                         for (mode, load), got in results.items()}}, indent=1))
    if args.plot_dir:
        for path in write_plots(runs, results, args.plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if all(run["summary"]["failed"] == 0 for run in runs) else 1
