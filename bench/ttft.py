"""`kvhandoff bench ttft`: the transfer time a disaggregated handoff leaves exposed, per data
plane, as TTFT(disaggregated over that plane) - TTFT(same engine in one process, decode
--local-prefill).

    kvhandoff bench ttft [--lengths 512,2048,8192] [--planes inline,shared-memory]
                         [--repeats 5] [--compare-checks] [--verify-full-fraction 0,1]
                         [--json OUT]

Each plane is its own prefill + decode pair, decode started with `--data-plane <plane>` (so a
plane that cannot be used makes its decode refuse to start, never fall back); a plane added
later (NIXL) is one more name in --planes. Besides the paired TTFT differences, decode's own log
gives per request the handoff's seconds (`handoff_verified`: queued to verified, so prefill's
forward pass, the transfer and the content checks) and the local prefill's
(`prefilled_locally`); their difference less the checks is the exposed transfer as decode's own
clock saw it (a difference of medians of two deployments: a cross-check, noisier).

One request at a time (max_tokens 1), so TTFT is prefill plus, when disaggregated, the part of
the KV transfer that per-layer streaming does not hide behind compute. Both deployments run
at once and take turns, request by request; the exposed time is the median of the paired
differences. The demo model's window
is 4096 positions; for longer prompts the benchmark writes the demo weights into a checkpoint
with a longer window (RoPE needs nothing else) in a temporary directory.

With --compare-checks one more deployment runs beside them: the first plane's pair with decode's
content checks off (--no-content-checks), so the checks' cost is a paired difference too; the
checks' own time per request is read from decode's `handoff_content_verified` log lines.

With --verify-full-fraction F0,F1,... the first plane's pair runs with decode's audit sampling
at F0 (SPEC.md D-49), and one more pair of that plane per further fraction, side by side: the
audit's cost is TTFT(F) - TTFT(F0), paired per round, and TTFT(F) / TTFT(F0); the audits' own
time per request is read from decode's `full_audit` log lines.
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
from bench.servers import model_vocab_size, start_deployment
from common.pb.kvhandoff.v1 import generate_pb2_grpc
from common.server.grpc_server import run_async
from bench.errors import BenchRequestFailed
from common.server.launch import ServiceStartError

DEMO_WINDOW = 4096
UNCHECKED = "disaggregated-unchecked"
AUDIT = "audit-"  # + the fraction: the first plane's pair at a further --verify-full-fraction


def log_seconds(decode_log: Path, event_name: str, field: str = "seconds"
                ) -> dict[int, list[float]]:
    """`field` (seconds) of decode's JSON log lines named event_name, per prompt length."""
    out: dict[int, list[float]] = {}
    if not decode_log.exists():
        return out
    for line in decode_log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == event_name and "prompt_tokens" in event:
            out.setdefault(int(event["prompt_tokens"]), []).append(float(event.get(field, 0.0)))
    return out


def _median_ms(values: list[float]) -> float | None:
    # the first request of each length is the warm-up round: the log has it too
    values = values[1:] if len(values) > 1 else values
    return statistics.median(values) * 1e3 if values else None


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
                        raise BenchRequestFailed(f"{mode}: {length}-token request failed: "
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
    p.add_argument("--planes", default="inline,shared-memory",
                   help="data planes, one disaggregated pair each (decode --data-plane NAME)")
    p.add_argument("--repeats", type=int, default=5, help="timed requests per length and mode")
    p.add_argument("--model", default="demo", help="'demo' or a checkpoint directory")
    p.add_argument("--torch-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="torch threads per service process (0: torch's default)")
    p.add_argument("--server-args", default="", help="extra flags for every service")
    p.add_argument("--compare-checks", action="store_true",
                   help="also run the first plane's pair with decode's content checks off")
    p.add_argument("--verify-full-fraction", default="", metavar="F0,F1,...",
                   help="decode's audit sampling: the first plane's pair at F0, and one more "
                        "pair of that plane per further fraction, side by side (empty: decode's "
                        "default, no extra pair)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    try:
        fractions = [_fraction(x) for x in args.verify_full_fraction.split(",") if x.strip()]
    except ValueError as err:
        p.error(f"--verify-full-fraction: {err}")
    if len(set(fractions)) != len(fractions):
        p.error("--verify-full-fraction: each fraction once")
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    planes = [x.strip() for x in args.planes.split(",") if x.strip()]
    if not planes or "local" in planes or UNCHECKED in planes:
        p.error("--planes: one or more data plane names")
    window = max(lengths) + 1
    with tempfile.TemporaryDirectory(prefix="kvh-bench-ttft-") as tmp:
        model = args.model
        if model == "demo" and window > DEMO_WINDOW:
            model = str(write_long_demo(Path(tmp) / "demo-long", window))
        pool = max(window // 16 + 2, 256) * 16  # whole pages, at least the window
        flags = ["--model", model, "--pool-tokens", str(pool), "--max-context-tokens",
                 str(window), *args.server_args.split()]
        plans = []
        for i, plane in enumerate(planes):
            first_audit = _audit_flags(fractions[0]) if i == 0 and fractions else []
            plans.append((plane, "disaggregated", ["--data-plane", plane, *first_audit]))
        audits = [f"{AUDIT}{f:g}" for f in fractions[1:]]
        for name, fraction in zip(audits, fractions[1:]):
            plans.append((name, "disaggregated", ["--data-plane", planes[0],
                                                  *_audit_flags(fraction)]))
        if args.compare_checks:
            plans.append((UNCHECKED, "disaggregated",
                          ["--data-plane", planes[0], "--no-content-checks"]))
        plans.append(("local", "local", []))
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
            logs = {name: Path(tmp) / name / mode / "decode.log" for name, mode, _ in plans}
            handoff_s = {name: log_seconds(logs[name], "handoff_verified") for name in planes}
            checks_s = {name: log_seconds(logs[name], "handoff_content_verified")
                        for name in planes}
            landed_s = {name: log_seconds(logs[name], "handoff_content_verified",
                                          "landed_seconds") for name in planes}
            local_s = log_seconds(logs["local"], "prefilled_locally")
            audit_s = {name: log_seconds(logs[name], "full_audit")
                       for name in [planes[0], *audits]}
        except ServiceStartError as err:  # e.g. a length past the model's window: one line
            print(f"\nkvhandoff bench ttft: {err}", file=sys.stderr)
            return 2
        finally:
            for deployment in deployments.values():
                deployment.stop()
    rows = []
    for length in lengths:
        local = per_mode["local"][length]
        row = {"prompt_tokens": length, "ttft_local_ms": statistics.median(local) * 1e3,
               "local_prefill_log_ms": _median_ms(local_s.get(length, [])), "planes": {},
               "samples_ms": {m: [t * 1e3 for t in per_mode[m][length]] for m in per_mode}}
        for plane in planes:
            ttft = per_mode[plane][length]
            exposed = statistics.median(a - b for a, b in zip(ttft, local))
            handoff = _median_ms(handoff_s[plane].get(length, []))
            checks = _median_ms(checks_s[plane].get(length, []))
            landed = _median_ms(landed_s[plane].get(length, []))
            exposed_log = (None if None in (handoff, checks, row["local_prefill_log_ms"]) else
                           handoff - checks - row["local_prefill_log_ms"])
            row["planes"][plane] = {
                "ttft_ms": statistics.median(ttft) * 1e3, "exposed_ms": exposed * 1e3,
                "exposed_share": exposed / statistics.median(ttft), "handoff_log_ms": handoff,
                "checks_log_ms": checks, "checks_landed_log_ms": landed,
                "exposed_log_ms": exposed_log}
        if args.compare_checks:
            unchecked = per_mode[UNCHECKED][length]
            cost = statistics.median(a - b for a, b in zip(per_mode[planes[0]][length],
                                                            unchecked))
            row |= {"ttft_unchecked_ms": statistics.median(unchecked) * 1e3,
                    "checks_cost_ms": cost * 1e3,
                    "checks_cost_share": cost / statistics.median(unchecked)}
        if audits:
            base = per_mode[planes[0]][length]
            row["audits"] = {f"{fractions[0]:g}": {
                "ttft_ms": statistics.median(base) * 1e3,
                "audit_log_ms": _median_ms(audit_s[planes[0]].get(length, []))}}
            for name, fraction in zip(audits, fractions[1:]):
                ttft = per_mode[name][length]
                row["audits"][f"{fraction:g}"] = {
                    "ttft_ms": statistics.median(ttft) * 1e3,
                    "cost_ms": statistics.median(a - b for a, b in zip(ttft, base)) * 1e3,
                    "ttft_ratio": statistics.median(ttft) / statistics.median(base),
                    "audit_log_ms": _median_ms(audit_s[name].get(length, []))}
        rows.append(row)
    _print(args, planes, rows)
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "ttft", "model": args.model,
                                         "torch_threads": args.torch_threads, "planes": planes,
                                         "rows": rows}, indent=2))
    return 0


def _audit_flags(fraction: float) -> list[str]:
    return ["--verify-full-fraction", repr(fraction)]


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{text.strip()} is not in [0, 1]")
    return value


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _print(args, planes: list[str], rows: list[dict]) -> None:
    print(f"model {args.model}, {args.torch_threads} torch threads per service, medians of "
          f"{args.repeats} rounds; exposed = TTFT(plane) - TTFT(local), paired per round")
    print(f"{'prompt':>7} {'plane':>14} {'TTFT ms':>9} {'local ms':>9} {'exposed ms':>11} "
          f"{'share':>7} {'handoff ms':>11} {'checks ms':>10} {'landed ms':>10} "
          f"{'exposed (log)':>13}")
    for r in rows:
        for plane in planes:
            c = r["planes"][plane]
            print(f"{r['prompt_tokens']:>7} {plane:>14} {c['ttft_ms']:>9.1f} "
                  f"{r['ttft_local_ms']:>9.1f} {c['exposed_ms']:>11.1f} "
                  f"{c['exposed_share']:>6.1%} {_ms(c['handoff_log_ms']):>11} "
                  f"{_ms(c['checks_log_ms']):>10} {_ms(c['checks_landed_log_ms']):>10} "
                  f"{_ms(c['exposed_log_ms']):>13}")
    print("(from decode's log: handoff = queued to verified; checks = the content checks after "
          "the commit, landed = their part run as the KV landed (engine time, hidden behind "
          "prefill's pass); exposed (log) = handoff - checks - the local prefill's own time, "
          "medians, so noisier than the paired TTFTs)")
    if any("audits" in r for r in rows):
        print(f"\n{'prompt':>7} {'audit F':>8} {'TTFT ms':>9} {'paired cost ms':>15} "
              f"{'TTFT / TTFT(F0)':>16} {'audit ms (log)':>15}  ({planes[0]})")
        for r in rows:
            for fraction, c in r["audits"].items():
                ratio = c.get("ttft_ratio")
                print(f"{r['prompt_tokens']:>7} {fraction:>8} {c['ttft_ms']:>9.1f} "
                      f"{_ms(c.get('cost_ms')):>15} "
                      f"{'-' if ratio is None else f'{ratio:.2f}x':>16} "
                      f"{_ms(c['audit_log_ms']):>15}")
    if args.compare_checks:
        print(f"\n{'prompt':>7} {'TTFT unchecked ms':>18} {'paired cost ms':>15} "
              f"{'cost / TTFT':>12}  ({planes[0]})")
        for r in rows:
            print(f"{r['prompt_tokens']:>7} {r['ttft_unchecked_ms']:>18.1f} "
                  f"{r['checks_cost_ms']:>15.1f} {r['checks_cost_share']:>11.1%}")
