"""`kvhandoff up`: a local cluster, prefill and decode as separate processes on loopback."""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb.kvhandoff.v1 import stats_pb2, stats_pb2_grpc


def wait_port_file(path: Path, proc: subprocess.Popen, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before serving")
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.05)
    raise TimeoutError(f"no port after {timeout}s")


def wait_serving(address: str, proc: subprocess.Popen, timeout: float) -> None:
    """Polls the standard health service until it says SERVING."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"process exited with {proc.returncode} before serving")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{address} not SERVING after {timeout}s")


def _pool_line(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        pool = stats_pb2_grpc.StatsServiceStub(channel).GetStats(
            stats_pb2.GetStatsRequest(), timeout=5).pool
    return f"{pool.tokens_total} tokens"


def _plane_line(address: str, wanted: str) -> str:
    """The plane decode agreed on: the same choice (common.handoff.planes) from the same info,
    on the same host, with decode's defaults (no TLS, /dev/shm)."""
    from common.handoff.planes import DEFAULT_SHM_DIR, choose_plane
    from common.pb.kvhandoff.v1 import handoff_pb2, handoff_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        info = handoff_pb2_grpc.HandoffServiceStub(channel).GetPrefillInfo(
            handoff_pb2.GetPrefillInfoRequest(), timeout=5)
    return choose_plane(info, wanted, DEFAULT_SHM_DIR, True)


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
    p.add_argument("--data-plane", default="auto", choices=("auto", "inline", "shared-memory"),
                   help="how KV travels; auto: the fastest plane both sides offer")
    p.add_argument("--start-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    common = ["--model", args.model, "--host", args.host, "--page-size", str(args.page_size),
              "--kernels", args.kernels, "--device", args.device,
              "--max-context-tokens", str(args.max_context_tokens)]
    cli = [sys.executable, "-m", "common.cli.main"]
    procs: list[subprocess.Popen] = []
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            prefill_port_file = Path(tmp) / "prefill.port"
            procs.append(subprocess.Popen(
                [*cli, "prefill", *common, "--port", str(args.prefill_port),
                 "--pool-tokens", str(args.prefill_pool_tokens), "--port-file",
                 str(prefill_port_file), *shlex.split(args.prefill_args)]))
            prefill_port = wait_port_file(prefill_port_file, procs[0], args.start_timeout)
            prefill_address = f"{args.host}:{prefill_port}"
            decode_port_file = Path(tmp) / "decode.port"
            procs.append(subprocess.Popen(
                [*cli, "decode", *common, "--port", str(args.port), "--prefill", prefill_address,
                 "--pool-tokens", str(args.decode_pool_tokens), "--data-plane", args.data_plane,
                 "--port-file",
                 str(decode_port_file), *shlex.split(args.decode_args)]))
            decode_port = wait_port_file(decode_port_file, procs[1], args.start_timeout)
            address = f"{args.host}:{decode_port}"
            wait_serving(prefill_address, procs[0], args.start_timeout)
            wait_serving(address, procs[1], args.start_timeout)
            with grpc.insecure_channel(address) as channel:
                limit = stats_pb2_grpc.StatsServiceStub(channel).GetStats(
                    stats_pb2.GetStatsRequest(), timeout=5).pool.max_prompt_tokens
            print(f"ready: kvhandoff serving at {address} (prefill at {prefill_address}); "
                  f"max prompt {limit} tokens; prefill pool {_pool_line(prefill_address)}, "
                  f"decode pool {_pool_line(address)}; data plane "
                  f"{_plane_line(prefill_address, args.data_plane)}", flush=True)
            while not stopping and all(proc.poll() is None for proc in procs):
                time.sleep(0.2)
            failed = [proc for proc in procs if proc.poll() not in (None, 0)]
            return 1 if failed and not stopping else 0
        except (RuntimeError, TimeoutError) as err:
            print(f"kvhandoff up: {err}", file=sys.stderr)
            return 1
        finally:
            for proc in reversed(procs):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
