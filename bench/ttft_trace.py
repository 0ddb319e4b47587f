"""Where a disaggregated request's time to first token goes, milestone by milestone, beside the
same engine in one process (decode --local-prefill), from the services' own logs.

    PYTHONPATH=. python bench/ttft_trace.py --model DIR [--lengths 128,512]
                 [--planes inline,shared-memory] [--repeats 10] [--server-args "--dtype bfloat16"]

With --baseline-tree DIR (another checkout: the tree before a change) each plane's pair also
runs from DIR, named PLANE@base, side by side with this tree's, so a change is measured A/B in
one run on the same load; half the requests then go in the reverse turn order (the first
deployment in turn follows the last one's leftovers: `_paired_ttfts`).

One request at a time (max_tokens 1), the deployments taking turns request by request (as
`kvhandoff bench ttft`). Per request, decode's `handoff_verified` line carries its timeline
(ms from the request's arrival: pages reserved, Prefill call opened, first frame (the header),
first chunk (prefill's layer 0 done), last chunk (its pass done), stream ended (commit read),
verified (form and content)); `handoff_content_verified` the content checks' seconds;
`request_finished` first_token_ms (the first token handed to the front door). Prefill's
`prefill_started` (header sent, job queued on its engine) and `prefill_streamed` (every frame
sent) are placed on the same axis through the log timestamps, and with them the marks
prefill_streamed carries (`marks_ago_ms`: the call received, the job admitted on the engine,
its first and last chunk and its commit handed to the event loop). Prints the median of each
milestone per plane and length, and the client's TTFT.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import servers  # noqa: E402
from bench.servers import model_vocab_size, start_deployment  # noqa: E402
from bench.ttft import _ttfts  # noqa: E402
from common.server.grpc_server import run_async  # noqa: E402


def _events(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _at(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def timelines(decode_log: Path, prefill_log: Path | None) -> dict[int, list[dict[str, float]]]:
    """Per prompt length, one {milestone: ms since arrival} per request (first is warm-up)."""
    by_request: dict[str, dict] = {}
    for event in _events(decode_log):
        rid = event.get("request_id")
        if rid is None:
            continue
        row = by_request.setdefault(rid, {})
        name = event.get("event")
        if name in ("handoff_verified", "prefilled_locally"):
            row["tokens"] = int(event["prompt_tokens"])
            row.update(event.get("timeline_ms") or {"verified": event["seconds"] * 1e3})
            row["_arrived"] = _at(event) - row["verified"] / 1e3
        elif name == "handoff_content_verified":
            row["checks after the commit (duration)"] = event["seconds"] * 1e3
            if event.get("landed_seconds"):
                row["checks as the KV landed (engine time)"] = event["landed_seconds"] * 1e3
        elif name == "request_finished" and event.get("first_token_ms") is not None:
            row["first token to front door"] = event["first_token_ms"]
    for event in _events(prefill_log) if prefill_log else []:
        row = by_request.get(event.get("request_id", ""))
        if row is None or "_arrived" not in row:
            continue
        if event.get("event") == "prefill_started":
            row["prefill: header sent, job queued"] = (_at(event) - row["_arrived"]) * 1e3
        elif event.get("event") == "prefill_streamed":
            row["prefill: every frame sent"] = (_at(event) - row["_arrived"]) * 1e3
            for name, ago in (event.get("marks_ago_ms") or {}).items():  # the engine's marks
                row[f"prefill: {name.replace('_', ' ')}"] = (
                    (_at(event) - row["_arrived"]) * 1e3 - ago)
    out: dict[int, list[dict[str, float]]] = {}
    for row in by_request.values():
        if "tokens" in row:
            row.pop("_arrived", None)
            out.setdefault(row.pop("tokens"), []).append(row)
    return out


def _start_from(tree: Path, mode: str, flags: list[str], workdir: Path, threads: int,
                decode_flags: list[str]):
    """start_deployment with the services run from tree (their cwd, so its modules load)."""
    repo = servers.REPO
    servers.REPO = tree.resolve()
    try:
        return start_deployment(mode, flags, workdir, threads, decode_flags)
    finally:
        servers.REPO = repo


async def _paired_ttfts(addresses: dict[str, str], lengths: list[int], repeats: int,
                        vocab: int, orders: int) -> dict[str, dict[int, list[float]]]:
    """bench.ttft._ttfts in `orders` rounds (1 or 2) of about repeats / orders requests each,
    the second with the deployments' turn order reversed: a deployment's request pays for what
    the one before it left running (a shared-memory decode's ReleaseHandoff, its prefill's pool
    prune), so in one order the first deployment is measured against a busier machine than
    the others; reversing the order for half the requests gives every one both neighbours."""
    out: dict[str, dict[int, list[float]]] = {name: {n: [] for n in lengths}
                                              for name in addresses}
    names = list(addresses)
    for k in range(orders):
        order = names if k % 2 == 0 else names[::-1]
        part = await _ttfts({name: addresses[name] for name in order}, lengths,
                            -(-repeats // orders), vocab, lambda text: None)
        for name in names:
            for n in lengths:
                out[name][n] += part[name][n]
    return out


def _median_rows(rows: list[dict[str, float]]) -> dict[str, float]:
    rows = rows[1:] if len(rows) > 1 else rows  # the warm-up round
    names = sorted({n for r in rows for n in r},
                   key=lambda n: statistics.median(r[n] for r in rows if n in r))
    return {n: statistics.median(r[n] for r in rows if n in r) for n in names}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--lengths", default="128,512")
    p.add_argument("--planes", default="inline,shared-memory")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--server-args", default="")
    p.add_argument("--decode-args", default="", help="extra flags for the disaggregated decodes")
    p.add_argument("--baseline-tree", type=Path,
                   help="another checkout whose pairs run beside this tree's (PLANE@base)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    planes = [x for x in args.planes.split(",") if x]
    window = max(lengths) + 1
    flags = ["--model", args.model, "--pool-tokens", str(max(window // 16 + 2, 256) * 16),
             "--max-context-tokens", str(window), *args.server_args.split()]
    plans = [(plane, "disaggregated", ["--data-plane", plane, *args.decode_args.split()])
             for plane in planes] + [("local", "local", [])]
    if args.baseline_tree:
        plans += [(f"{plane}@base", "disaggregated", flags) for plane, mode, flags in plans
                  if mode == "disaggregated"]
    with tempfile.TemporaryDirectory(prefix="kvh-ttft-trace-") as tmp:
        deployments = {}
        try:
            for name, mode, decode_flags in plans:
                print(f"[{name}] starting services ...", file=sys.stderr, flush=True)
                deployments[name] = _start_from(
                    args.baseline_tree if name.endswith("@base") else servers.REPO,
                    mode, flags, Path(tmp) / name, args.torch_threads, decode_flags)
            ttft = run_async(lambda: _paired_ttfts(
                {n: d.address for n, d in deployments.items()}, lengths, args.repeats,
                model_vocab_size(args.model), 2 if args.baseline_tree else 1))
        finally:
            for deployment in deployments.values():
                deployment.stop()
        result = {}
        for name, mode, _ in plans:
            root = Path(tmp) / name / mode
            prefill_log = root / "prefill.log" if mode != "local" else None
            per_length = timelines(root / "decode.log", prefill_log)
            result[name] = {n: {"client_ttft_ms": statistics.median(ttft[name][n]) * 1e3,
                                "milestones_ms": _median_rows(per_length.get(n, []))}
                            for n in lengths}
    print(f"model {args.model} {args.server_args}, {args.torch_threads} torch thread(s) per "
          f"service, medians of {args.repeats} requests, ms since decode got the request")
    for n in lengths:
        for name in result:
            r = result[name][n]
            print(f"{n} tokens, {name}: client TTFT {r['client_ttft_ms']:.1f}")
            for milestone, ms in r["milestones_ms"].items():
                print(f"    {milestone:40s} {ms:8.2f}")
    if args.json:
        given = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"benchmark": "ttft_trace", "args": given,
                                         "result": result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
