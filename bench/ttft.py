"""`kvhandoff bench ttft`: the transfer time a disaggregated handoff leaves exposed, as
TTFT(disaggregated) - TTFT(same engine in one process, decode --local-prefill).

    kvhandoff bench ttft [--lengths 512,2048,8192] [--repeats 5] [--compare-checks] [--json OUT]

One request at a time (max_tokens 1), so TTFT is prefill plus, when disaggregated, the part of
the KV transfer that per-layer streaming does not hide behind compute. Both deployments run
at once and take turns, request by request; the exposed time is the median of the paired
differences. The demo model's window
is 4096 positions; for longer prompts the benchmark writes the demo weights into a checkpoint
with a longer window (RoPE needs nothing else) in a temporary directory.

With --compare-checks a third deployment runs beside them: the disaggregated pair with decode's
content checks off (--no-content-checks), so the checks' cost is a paired difference too; the
checks' own time per request is read from decode's `handoff_content_verified` log lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import grpc

from bench.serve_client import RequestSpec, run_one
from bench.servers import MODES, model_vocab_size, start_deployment
from common.pb.kvhandoff.v1 import generate_pb2_grpc
from common.server.grpc_server import run_async

DEMO_WINDOW = 4096
UNCHECKED = "disaggregated-unchecked"


def verify_seconds(decode_log: Path) -> dict[int, list[float]]:
    """Content-check seconds per prompt length, from decode's JSON log lines."""
    out: dict[int, list[float]] = {}
    if not decode_log.exists():
        return out
    for line in decode_log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "handoff_content_verified":
            out.setdefault(int(event["prompt_tokens"]), []).append(float(event["seconds"]))
    return out


def write_long_demo(root: Path, max_positions: int) -> Path:
    """The demo model as a checkpoint directory whose window is max_positions."""
    from safetensors.torch import save_file

    from common.model.demo import build_demo_model, demo_hf_config

    demo = build_demo_model()
    config = {**demo_hf_config(demo.config.vocab_size), "max_position_embeddings": max_positions}
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in demo.weights.items()}, str(root / "model.safetensors"))
    return root


async def _ttfts(addresses: dict[str, str], lengths: list[int], repeats: int, vocab: int,
                 progress) -> dict[str, dict[int, list[float]]]:
    """TTFT samples per mode and length; the modes take turns request by request, so a change
    in the machine's load hits both alike."""
    out: dict[str, dict[int, list[float]]] = {mode: {} for mode in addresses}
    channels = {mode: grpc.aio.insecure_channel(address) for mode, address in addresses.items()}
    try:
        stubs = {m: generate_pb2_grpc.GenerationServiceStub(c) for m, c in channels.items()}
        for length in lengths:
            ids = [(7 * i + 3) % (vocab - 3) + 3 for i in range(length)]
            for mode in addresses:
                out[mode][length] = []
            for rep in range(repeats + 1):  # the first round is a warm-up
                for mode, stub in stubs.items():
                    result = await run_one(stub, RequestSpec(ids, 1), 600.0)
                    if not result.ok:
                        raise RuntimeError(f"{mode}: {length}-token request failed: "
                                           f"{result.error}")
                    if rep:
                        out[mode][length].append(result.ttft)
                progress(f"{length} tokens {rep}/{repeats}")
    finally:
        for channel in channels.values():
            await channel.close()
    return out



def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvhandoff bench ttft", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--lengths", default="512,2048,8192",
                   help="prompt lengths in tokens, comma separated")
    p.add_argument("--repeats", type=int, default=5, help="timed requests per length and mode")
    p.add_argument("--model", default="demo", help="'demo' or a checkpoint directory")
    p.add_argument("--torch-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="torch threads per service process (0: torch's default)")
    p.add_argument("--server-args", default="", help="extra flags for every service")
    p.add_argument("--compare-checks", action="store_true",
                   help="also run the pair with decode's content checks off, to price them")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    window = max(lengths) + 1
    with tempfile.TemporaryDirectory(prefix="kvh-bench-ttft-") as tmp:
        model = args.model
        if model == "demo" and window > DEMO_WINDOW:
            model = str(write_long_demo(Path(tmp) / "demo-long", window))
        pool = max(window // 16 + 2, 256) * 16  # whole pages, at least the window
        flags = ["--model", model, "--pool-tokens", str(pool), "--max-context-tokens",
                 str(window), *args.server_args.split()]
        plans = [(mode, mode, []) for mode in MODES]
        if args.compare_checks:
            plans.insert(1, (UNCHECKED, "disaggregated", ["--no-content-checks"]))
        deployments = {}
        try:
            for name, mode, decode_flags in plans:
                print(f"[{name}] starting services ...", file=sys.stderr, flush=True)
                deployments[name] = start_deployment(mode, flags, Path(tmp) / name,
                                                     args.torch_threads, decode_flags)
            per_mode = run_async(lambda: _ttfts(
                {name: d.address for name, d in deployments.items()}, lengths, args.repeats,
                model_vocab_size(model),
                lambda text: print(f"\r[ttft] {text}   ", end="", file=sys.stderr, flush=True)))
            print(file=sys.stderr)
            verify_s = verify_seconds(Path(tmp) / "disaggregated" / "disaggregated" / "decode.log")
        finally:
            for deployment in deployments.values():
                deployment.stop()
    rows = []
    for length in lengths:
        disaggregated = statistics.median(per_mode["disaggregated"][length])
        local = statistics.median(per_mode["local"][length])
        paired = [a - b for a, b in zip(per_mode["disaggregated"][length],
                                        per_mode["local"][length])]
        exposed = statistics.median(paired)
        rows.append({"prompt_tokens": length, "ttft_disaggregated_ms": disaggregated * 1e3,
                     "ttft_local_ms": local * 1e3, "exposed_ms": exposed * 1e3,
                     "exposed_share": exposed / disaggregated,
                     "samples_ms": {m: [t * 1e3 for t in per_mode[m][length]] for m in per_mode}})
        checks = verify_s.get(length, [])
        rows[-1]["verify_ms"] = statistics.median(checks) * 1e3 if checks else None
        if args.compare_checks:
            unchecked = per_mode[UNCHECKED][length]
            cost = statistics.median(a - b for a, b in zip(per_mode["disaggregated"][length],
                                                            unchecked))
            rows[-1] |= {"ttft_unchecked_ms": statistics.median(unchecked) * 1e3,
                         "checks_cost_ms": cost * 1e3,
                         "checks_cost_share": cost / statistics.median(unchecked)}
    print(f"model {args.model}, {args.torch_threads} torch threads per service, medians of "
          f"{args.repeats} rounds")
    print(f"{'prompt':>7} {'TTFT disagg ms':>15} {'TTFT local ms':>14} {'exposed ms':>11} "
          f"{'share of TTFT':>14}")
    for r in rows:
        print(f"{r['prompt_tokens']:>7} {r['ttft_disaggregated_ms']:>15.1f} "
              f"{r['ttft_local_ms']:>14.1f} {r['exposed_ms']:>11.1f} {r['exposed_share']:>13.1%}")
    print(f"\n{'prompt':>7} {'checks ms (log)':>16} {'TTFT unchecked ms':>18} "
          f"{'paired cost ms':>15} {'cost / TTFT':>12}")
    for r in rows:
        verify = "-" if r["verify_ms"] is None else f"{r['verify_ms']:.1f}"
        if "checks_cost_ms" in r:
            print(f"{r['prompt_tokens']:>7} {verify:>16} {r['ttft_unchecked_ms']:>18.1f} "
                  f"{r['checks_cost_ms']:>15.1f} {r['checks_cost_share']:>11.1%}")
        else:
            print(f"{r['prompt_tokens']:>7} {verify:>16} (run with --compare-checks for the "
                  f"paired cost)")
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "ttft", "model": args.model,
                                         "torch_threads": args.torch_threads, "rows": rows},
                                        indent=2))
    return 0
