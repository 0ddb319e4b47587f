"""`kvhandoff up`: a local cluster, prefill and decode as separate processes on loopback."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpc

from common.pb.kvhandoff.v1 import stats_pb2, stats_pb2_grpc
from common.server.launch import ServiceProcess, launch, stop_processes
from common.server.wait import wait_serving


def _pool_line(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        pool = stats_pb2_grpc.StatsServiceStub(channel).GetStats(
            stats_pb2.GetStatsRequest(), timeout=5).pool
    return f"{pool.tokens_total} tokens"


def up(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvhandoff up", description=__doc__)
    p.add_argument("--model", default="demo")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="client-facing (decode) port")
    p.add_argument("--prefill-port", type=int, default=0)
    p.add_argument("--max-context-tokens", type=int, default=0)
    p.add_argument("--prefill-pool-tokens", type=int, default=65536)
    p.add_argument("--decode-pool-tokens", type=int, default=65536)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kernels", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--prefill-args", default="", help="extra flags for prefill, one string")
    p.add_argument("--decode-args", default="", help="extra flags for decode, one string")
    p.add_argument("--start-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    common = ["--model", args.model, "--host", args.host, "--page-size", str(args.page_size),
              "--kernels", args.kernels, "--device", args.device,
              "--max-context-tokens", str(args.max_context_tokens)]
    cli = [sys.executable, "-m", "common.cli.main"]
    services: list[ServiceProcess] = []
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            services.append(launch(
                "prefill", [*cli, "prefill", *common, "--port", str(args.prefill_port),
                            "--pool-tokens", str(args.prefill_pool_tokens),
                            *shlex.split(args.prefill_args)],
                Path(tmp) / "prefill.port", args.start_timeout, host=args.host,
                wait_until_serving=False))
            prefill_address = services[0].address
            services.append(launch(
                "decode", [*cli, "decode", *common, "--port", str(args.port), "--prefill",
                           prefill_address, "--pool-tokens", str(args.decode_pool_tokens),
                           *shlex.split(args.decode_args)],
                Path(tmp) / "decode.port", args.start_timeout, host=args.host,
                wait_until_serving=False))
            address = services[1].address
            for service in services:  # both warm up at once; each wait is for its own process
                wait_serving(service.address, args.start_timeout, proc=service.proc)
            with grpc.insecure_channel(address) as channel:
                limit = stats_pb2_grpc.StatsServiceStub(channel).GetStats(
                    stats_pb2.GetStatsRequest(), timeout=5).pool.max_prompt_tokens
            print(f"ready: kvhandoff serving at {address} (prefill at {prefill_address}); "
                  f"max prompt {limit} tokens; prefill pool {_pool_line(prefill_address)}, "
                  f"decode pool {_pool_line(address)}", flush=True)
            procs = [service.proc for service in services]
            while not stopping and all(proc.poll() is None for proc in procs):
                time.sleep(0.2)
            failed = [proc for proc in procs if proc.poll() not in (None, 0)]
            return 1 if failed and not stopping else 0
        except (RuntimeError, TimeoutError) as err:
            print(f"kvhandoff up: {err}", file=sys.stderr)
            return 1
        finally:
            stop_processes([service.proc for service in reversed(services)], timeout=15)
