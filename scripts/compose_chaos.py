"""Replicas and chaos in the compose cluster, bounded for CI (scripts/compose_smoke.sh runs it on
2 prefills x 2 decodes; clients go through each decode's published port on 127.0.0.1):

  python scripts/compose_chaos.py --project P --compose "docker compose -p P -f ... -f ..."

Phases, each printed as one JSON line with its figures, then a summary line:
- serve: streams through every decode; every decode streams and every prefill's GetStats shows
  handoffs it served (decode spreads unscoped requests over idle replicas in turn);
- prefill_kill: 24 concurrent streams (prompts of a few hundred tokens, so handoffs are on the
  shared-memory plane when it lands), `docker kill -s KILL` of one prefill once the first
  streams have their first token: no client request fails (decode asks another replica before
  the first token), then every pool at baseline (pages free, nothing running or waiting) on
  every survivor and on the killed replica once back, and no shared-memory region left in the
  volume (the killed replica's leases are gone: decode unlinked what it opened);
- dns: under load, `--scale prefill=1` then back to 2: each decode logs
  prefill_replica_removed, then prefill_replica_added, and no request fails;
- decode_kill: streams on both decodes, one decode SIGKILLed mid-stream (its clients asked for
  3000 tokens, so the kill lands mid-stream however slow the host): its clients get
  UNAVAILABLE (the message they print is reported), the other decode's clients finish every
  token; the killed decode comes back and all pools are at baseline.
Exit status 0 only when every check held.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compose_chaos_cluster import Cluster, ClusterError, wait_for  # noqa: E402
from compose_smoke_client import Stream, complete, run_stream  # noqa: E402


def prompts(count: int, low: int, high: int, seed: int) -> list[list[int]]:
    """Distinct token prompts (ids 2..95: inside the demo model's 98, never bos/eos)."""
    rng = random.Random(seed)
    return [[rng.randrange(2, 96) for _ in range(rng.randrange(low, high + 1))]
            for _ in range(count)]


def launch(targets: list[str], max_tokens: int, prompt_list: list[list[int]], timeout: float
           ) -> tuple[list[Stream], list[threading.Thread]]:
    streams = [Stream() for _ in prompt_list]
    threads = [threading.Thread(target=run_stream, daemon=True,
                                args=(targets[i % len(targets)], max_tokens, s, timeout,
                                      prompt_list[i]))
               for i, s in enumerate(streams)]
    for thread in threads:
        thread.start()
    return streams, threads


def counter_sum(stats, prefix: str) -> int:
    return sum(v for k, v in stats.counters.items() if k.startswith(prefix))


def baselines(cluster: Cluster, timeout: float = 40.0) -> dict:
    """Waits until every running container's pool is at baseline and no region is left."""
    running = [r for s in ("prefill", "decode") for r in cluster.replicas(s)
               if cluster.running(r.container)]

    def check():
        stats = {r.name: cluster.stats(r) for r in running}
        if all(s.at_baseline and not s.regions for s in stats.values()):
            return stats
        return None

    try:
        stats = wait_for("pools at baseline, no region left", check, timeout, interval=2.0)
    except ClusterError:
        stats = {r.name: cluster.stats(r) for r in running}
        raise ClusterError("not at baseline: " + json.dumps(
            {n: {"pool": s.pool, "regions": len(s.regions)} for n, s in stats.items()})) from None
    return {n: f"{s.pool['pages_free']}/{s.pool['pages_total']} free, "
               f"{len(s.regions)} regions" for n, s in stats.items()}


def phase_serve(cluster: Cluster, args) -> dict:
    prefills, decodes = cluster.replicas("prefill"), cluster.replicas("decode")
    before = {p.name: cluster.stats(p).counters.get("handoffs_completed", 0) for p in prefills}
    problems, served = [], Counter()
    for decode in decodes:
        for prompt in prompts(args.serve_requests, 8, 40, seed=decode.number):
            stream = Stream()
            run_stream(decode.api, 16, stream, args.timeout, prompt)
            problems += [f"{decode.name}: {p}" for p in complete(stream, 16)]
            served[decode.name] += not complete(stream, 16)
    handoffs = {p.name: cluster.stats(p).counters.get("handoffs_completed", 0) - before[p.name]
                for p in prefills}
    problems += [f"{d.name} streamed nothing" for d in decodes if not served[d.name]]
    problems += [f"{name} served no handoff" for name, n in handoffs.items() if n < 1]
    return {"decodes": {d.name: d.api for d in decodes}, "streams_completed": dict(served),
            "prefill_handoffs": handoffs, "problems": problems}


def phase_prefill_kill(cluster: Cluster, args) -> dict:
    decodes = cluster.replicas("decode")
    victim = cluster.replicas("prefill")[-1]
    before = {d.name: cluster.stats(d) for d in decodes}
    started = time.time()
    streams, threads = launch([d.api for d in decodes], args.kill_tokens,
                              prompts(args.streams, 1500, 3500, seed=26), args.timeout)
    wait_for("first tokens before the kill",
             lambda: sum(s.tokens > 0 for s in streams) >= args.kill_after, args.timeout, 0.05)
    first_at_kill = sum(s.tokens > 0 for s in streams)
    cluster.kill(victim)
    for thread in threads:
        thread.join(args.timeout)
    failed = {i: complete(s, args.kill_tokens) for i, s in enumerate(streams)}
    failed = {i: p for i, p in failed.items() if p}
    back = cluster.ensure_running(victim)
    pools = baselines(cluster)
    after = {d.name: cluster.stats(d) for d in decodes}
    retried = {n: counter_sum(after[n], "handoff_retried_") -
               counter_sum(before[n], "handoff_retried_") for n in after}
    refusals = Counter(e.get("refusal", "?") for d in decodes for e in cluster.events(d, started)
                       if e["event"] == "handoff_retried")
    victim_log = cluster.events(victim, started)  # the killed process's lines stay in its log
    in_flight = ({e.get("request_id") for e in victim_log if e["event"] == "prefill_started"}
                 - {e.get("request_id") for e in victim_log if e["event"] == "prefill_streamed"})
    problems = [f"request {i}: {'; '.join(p)}" for i, p in failed.items()]
    if not sum(retried.values()):
        problems.append("no handoff was retried: the kill hit no handoff in flight")
    return {"victim": victim.name, "requests": len(streams), "failed": len(failed),
            "first_token_before_kill": first_at_kill,
            "victim_handoffs_cut": len(in_flight), "retried": retried,
            "retried_refusals": dict(refusals), "victim_back": back, "pools": pools,
            "problems": problems}


def phase_dns(cluster: Cluster, args) -> dict:
    decodes = cluster.replicas("decode")
    stop, done = threading.Event(), []

    def load(target: str, seed: int) -> None:
        for n in range(10_000):
            if stop.is_set():
                return
            stream = Stream()
            run_stream(target, 8, stream, args.timeout, prompts(1, 8, 40, seed * 1000 + n)[0])
            done.append(complete(stream, 8))

    workers = [threading.Thread(target=load, args=(d.api, i), daemon=True)
               for i, d in enumerate(decodes * 2)]
    for worker in workers:
        worker.start()
    seen = {}
    try:
        for count, event in ((1, "prefill_replica_removed"), (2, "prefill_replica_added")):
            since = time.time()
            cluster.scale(count, len(decodes))
            wait_for(f"{event} in every decode's log",
                     lambda event=event, since=since: all(
                         any(e["event"] == event for e in cluster.events(d, since))
                         for d in decodes), 60.0, 2.0)
            seen[event] = round(time.time() - since, 1)
        newest = cluster.replicas("prefill")[-1]
        cluster.wait_healthy(newest.container, 240.0)
        time.sleep(3.0)  # a few requests with the new replica in the set
    finally:
        stop.set()
        for worker in workers:
            worker.join(args.timeout)
    failures = [p for p in done if p]
    return {"requests": len(done), "failed": len(failures), "seconds_to_log": seen,
            "prefills": [p.name for p in cluster.replicas("prefill")],
            "problems": [f"request: {'; '.join(p)}" for p in failures[:5]]}


def phase_decode_kill(cluster: Cluster, args) -> dict:
    decodes = cluster.replicas("decode")
    victim, others = decodes[0], decodes[1:]
    # the victim's streams are far too long to finish before the kill lands (a slow host
    # once let 200-token ones finish first); the others must finish every token
    groups = {d.name: launch([d.api], args.victim_tokens if d == victim
                             else args.decode_kill_tokens,
                             prompts(args.decode_kill_streams, 8, 40, seed=d.number),
                             args.timeout) for d in decodes}
    wait_for("every stream's first token", lambda: all(
        s.tokens for streams, _ in groups.values() for s in streams), args.timeout, 0.05)
    cluster.kill(victim)
    for _, threads in groups.values():
        for thread in threads:
            thread.join(args.timeout)
    problems = []
    victims = groups[victim.name][0]
    printed = Counter(s.error for s in victims)
    for i, s in enumerate(victims):
        if not s.error.startswith("UNAVAILABLE: ") or len(s.error) <= len("UNAVAILABLE: "):
            problems.append(f"{victim.name} request {i}: {s.error or 'no error'} "
                            f"after {s.tokens} tokens, not UNAVAILABLE with a reason")
    for other in others:
        for i, s in enumerate(groups[other.name][0]):
            problems += [f"{other.name} request {i}: {p}"
                         for p in complete(s, args.decode_kill_tokens)]
    back = cluster.ensure_running(victim)
    pools = baselines(cluster)
    return {"victim": victim.name, "victim_requests": len(victims),
            "victim_tokens_before_kill": sorted(s.tokens for s in victims),
            "victim_clients_printed": dict(printed),
            "others_completed": sum(not complete(s, args.decode_kill_tokens)
                                    for o in others for s in groups[o.name][0]),
            "victim_back": back, "pools": pools, "problems": problems}


PHASES = {"serve": phase_serve, "prefill_kill": phase_prefill_kill, "dns": phase_dns,
          "decode_kill": phase_decode_kill}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", required=True, help="the compose project name")
    parser.add_argument("--compose", required=True,
                        help="the compose command with -p and every -f, as one string")
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per generation")
    parser.add_argument("--serve-requests", type=int, default=4, help="per decode")
    parser.add_argument("--streams", type=int, default=24)
    parser.add_argument("--kill-after", type=int, default=1,
                        help="first tokens seen before the prefill is killed")
    parser.add_argument("--kill-tokens", type=int, default=16)
    parser.add_argument("--decode-kill-streams", type=int, default=4, help="per decode")
    parser.add_argument("--decode-kill-tokens", type=int, default=200,
                        help="tokens each client of the surviving decode must get")
    parser.add_argument("--victim-tokens", type=int, default=3000,
                        help="tokens asked of the killed decode (cut long before)")
    args = parser.parse_args(argv)
    unknown = set(args.phases.split(",")) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases {sorted(unknown)} (choose from {', '.join(PHASES)})")
    cluster = Cluster(args.project, tuple(shlex.split(args.compose)))
    summary, ok = {}, True
    for name in args.phases.split(","):
        started = time.monotonic()
        try:
            result = PHASES[name](cluster, args)
        except ClusterError as err:
            result = {"problems": [str(err)]}
        result = {"phase": name, "ok": not result["problems"],
                  "seconds": round(time.monotonic() - started, 1), **result}
        print(json.dumps(result), flush=True)
        summary[name] = {k: v for k, v in result.items() if k not in ("pools", "phase")}
        ok &= result["ok"]
        if not result["ok"]:
            break
    print(json.dumps({"check": "chaos", "ok": ok, "phases": summary}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
