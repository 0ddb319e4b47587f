"""Prefix-cache hit rate and TTFT with 1 vs N prefill replicas, round-robin vs prefix-aware
choice (decode_svc/prefill_choice.py), under a shared-prefix workload.

Workload: --tenants cache scopes (one cache_salt each), each with its own shared prefix of
--prefix-len tokens; --requests-per-tenant requests per tenant, each the prefix and a unique
suffix, sent by --concurrency client threads in an interleaved order. Hit rate: prefill's
prefix_cache_hit_tokens (summed over replicas, from GetStats) over the prompt tokens sent.
Real processes on 127.0.0.1 (the demo model); prints one line per setup and writes JSON.

  python -m bench.prefill_choice --replicas 3 --out /tmp/prefill_choice.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from common.pb.kvhandoff.v1 import generate_pb2, generate_pb2_grpc
from tests.helpers.cluster import start_service

FLAGS = ["--model", "demo", "--pool-tokens", "8192", "--page-size", "16"]


def workload(tenants: int, per_tenant: int, prefix_len: int, suffix_len: int):
    """[(salt, token ids)], tenants interleaved so every replica sees every scope early."""
    prefixes = [[3 + (7 * t + 13 * i) % 90 for i in range(prefix_len)] for t in range(tenants)]
    return [(f"tenant-{t}", prefixes[t] + [3 + (r * 31 + j * 17 + t) % 90
                                           for j in range(suffix_len)])
            for r in range(per_tenant) for t in range(tenants)]


def one(address: str, salt: str, prompt: list[int]) -> float:
    request = generate_pb2.GenerateRequest(max_tokens=2, ignore_eos=True, cache_salt=salt)
    request.token_ids.ids.extend(prompt)
    start = time.monotonic()
    ttft = None
    with grpc.insecure_channel(address) as channel:
        for response in generate_pb2_grpc.GenerationServiceStub(channel).Generate(
                request, timeout=300):
            if ttft is None and response.HasField("token"):
                ttft = time.monotonic() - start
    return ttft


def run_setup(root: Path, replicas: int, choice: str, args) -> dict:
    services = []
    try:
        prefills = [start_service("prefill", root / f"p{i}", FLAGS) for i in range(replicas)]
        services += prefills
        target = ",".join(p.address for p in prefills)
        decode = start_service("decode", root / "d", [*FLAGS, "--prefill", target,
                                                      "--prefill-choice", choice])
        services.append(decode)
        jobs = workload(args.tenants, args.requests_per_tenant, args.prefix_len,
                        args.suffix_len)
        with ThreadPoolExecutor(args.concurrency) as pool:
            ttfts = list(pool.map(lambda job: one(decode.address, *job), jobs))
        hits = [p.stats().counters.get("prefix_cache_hit_tokens", 0) for p in prefills]
        sent = sum(len(prompt) for _, prompt in jobs)
        return {"replicas": replicas, "choice": choice, "requests": len(jobs),
                "prompt_tokens": sent, "hit_tokens": sum(hits), "hit_tokens_by_replica": hits,
                "hit_rate": sum(hits) / sent, "ttft_mean_s": statistics.mean(ttfts),
                "ttft_p50_s": statistics.median(ttfts)}
    finally:
        for service in reversed(services):
            service.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--requests-per-tenant", type=int, default=6)
    p.add_argument("--prefix-len", type=int, default=128)
    p.add_argument("--suffix-len", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    setups = [(1, "prefix"), (args.replicas, "round-robin"), (args.replicas, "prefix")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (replicas, choice) in enumerate(setups):
            result = run_setup(Path(tmp) / f"s{i}", replicas, choice, args)
            results.append(result)
            print(f"{replicas} replica(s) {choice:11s}: hit rate {result['hit_rate']:.3f} "
                  f"({result['hit_tokens']}/{result['prompt_tokens']} tokens, by replica "
                  f"{result['hit_tokens_by_replica']}), TTFT mean {result['ttft_mean_s']:.3f}s "
                  f"p50 {result['ttft_p50_s']:.3f}s", flush=True)
    base = results[0]["hit_rate"]
    for result in results[1:]:
        print(f"{result['replicas']} {result['choice']}: "
              f"{result['hit_rate'] / base:.2f}x one replica's hit rate")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                        "results": results}, indent=2))


if __name__ == "__main__":
    main()
