"""`kvhandoff up`: a local cluster, prefill and decode as separate processes on loopback."""

from __future__ import annotations

import argparse
import collections
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb.kvhandoff.v1 import stats_pb2, stats_pb2_grpc
from common.server.ports import PortUnavailable, check_port_free
from kvhandoff_cli.arguments import HelpFormatter

DEMO_NOTE = ("model 'demo': random weights, so its text is noise by design; its tokenizer has "
             "98 ids (<bos>, <eos>, one per printable ASCII character and newline); --model DIR "
             "serves a Hugging Face checkpoint directory (Llama, Qwen2)")


class ChildStderr:
    """Copies a child's stderr to ours line by line and keeps the last lines, so that `up` can
    say why a child failed (its refusal is a line starting with `kvhandoff ROLE:`)."""

    def __init__(self, role: str, proc: subprocess.Popen) -> None:
        self.role = role
        self.lines: collections.deque[str] = collections.deque(maxlen=50)
        self._thread = threading.Thread(target=self._copy, args=(proc.stderr,), daemon=True)
        self._thread.start()

    def _copy(self, stream) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))
            sys.stderr.write(line)
            sys.stderr.flush()

    def why(self) -> str:
        self._thread.join(timeout=2)  # the child has exited: its last lines are on the way
        lines = [line for line in self.lines if line.strip()]
        own = [line for line in lines if line.startswith(f"kvhandoff {self.role}")]
        return (own or lines or ["(it wrote nothing to stderr)"])[-1]


def _failed(child: ChildStderr, proc: subprocess.Popen, err: Exception) -> str:
    """One line naming the child that failed and why."""
    if proc.poll() is None:
        return f"{child.role}: {err}"
    return f"{child.role} exited with status {proc.returncode} before serving: {child.why()}"


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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvhandoff up", formatter_class=HelpFormatter,
                                description="Start a local cluster, prefill and decode as two "
                                "processes on loopback, and print one 'ready' line with the "
                                "address once both are SERVING; Ctrl-C or SIGTERM stops both.")
    p.add_argument("--model", default="demo",
                   help="'demo' (built in, random weights) or a Hugging Face checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address both services bind")
    p.add_argument("--port", type=int, default=50051, help="client-facing (decode) port")
    p.add_argument("--prefill-port", type=int, default=0, help="prefill's port (0: a free one)")
    p.add_argument("--metrics-port", type=int,
                   default=int(os.environ.get("KVHANDOFF_METRICS_PORT") or -1),
                   help="decode's /metrics port; prefill's is the next one (0: free ones; -1: "
                        "off; default from $KVHANDOFF_METRICS_PORT)")
    p.add_argument("--max-context-tokens", type=int, default=0,
                   help="context window (0: the model's)")
    p.add_argument("--pool-tokens", type=int, default=None,
                   help="KV pool size in tokens of both services (0: size from "
                        "--memory-fraction/--kv-cache-bytes); see the next two")
    p.add_argument("--prefill-pool-tokens", type=int, default=65536,
                   help="prefill's KV pool in tokens (--pool-tokens overrides)")
    p.add_argument("--decode-pool-tokens", type=int, default=65536,
                   help="decode's KV pool in tokens (--pool-tokens overrides)")
    p.add_argument("--memory-fraction", type=float, default=0.0,
                   help="share of free device memory for KV when the pool size is 0")
    p.add_argument("--kv-cache-bytes", type=int, default=0,
                   help="KV byte budget on the CPU when the pool size is 0")
    p.add_argument("--allow-context-beyond-pool", action="store_true",
                   help="start even if a pool is smaller than the window; the pool then bounds "
                        "prompts")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--kernels", default="auto", help="auto, triton or torch")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    p.add_argument("--prefill-args", default="", help="extra flags for prefill, one string")
    p.add_argument("--decode-args", default="", help="extra flags for decode, one string")
    p.add_argument("--start-timeout", type=float, default=300.0,
                   help="seconds each service may take to start")
    return p


def _metrics_ports(port: int) -> tuple[int, int]:
    """(prefill, decode) /metrics ports for up's --metrics-port."""
    return (port if port <= 0 else port + 1), port


def up(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    prefill_metrics, decode_metrics = _metrics_ports(args.metrics_port)
    try:
        for port, flag in ((args.port, "--port"), (args.prefill_port, "--prefill-port"),
                           (decode_metrics, "--metrics-port"),
                           (prefill_metrics, "--metrics-port (plus one, for prefill)")):
            if port > 0:
                check_port_free(args.host, port, flag)
    except PortUnavailable as err:
        print(f"kvhandoff up: refusing to start: {err}", file=sys.stderr)
        return 2
    if args.pool_tokens is not None:
        args.prefill_pool_tokens = args.decode_pool_tokens = args.pool_tokens
    common = ["--model", args.model, "--host", args.host, "--page-size", str(args.page_size),
              "--kernels", args.kernels, "--device", args.device, "--dtype", args.dtype,
              "--max-context-tokens", str(args.max_context_tokens),
              "--memory-fraction", str(args.memory_fraction),
              "--kv-cache-bytes", str(args.kv_cache_bytes)]
    if args.allow_context_beyond_pool:
        common.append("--allow-context-beyond-pool")
    cli = [sys.executable, "-m", "kvhandoff_cli.main"]
    procs: list[subprocess.Popen] = []
    children: list[ChildStderr] = []
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
                 str(prefill_port_file), "--metrics-port", str(prefill_metrics),
                 *shlex.split(args.prefill_args)], stderr=subprocess.PIPE, text=True))
            children.append(ChildStderr("prefill", procs[0]))
            prefill_port = wait_port_file(prefill_port_file, procs[0], args.start_timeout)
            prefill_address = f"{args.host}:{prefill_port}"
            decode_port_file = Path(tmp) / "decode.port"
            procs.append(subprocess.Popen(
                [*cli, "decode", *common, "--port", str(args.port), "--prefill", prefill_address,
                 "--pool-tokens", str(args.decode_pool_tokens), "--port-file",
                 str(decode_port_file), "--metrics-port", str(decode_metrics),
                 *shlex.split(args.decode_args)], stderr=subprocess.PIPE, text=True))
            children.append(ChildStderr("decode", procs[1]))
            decode_port = wait_port_file(decode_port_file, procs[1], args.start_timeout)
            address = f"{args.host}:{decode_port}"
            wait_serving(prefill_address, procs[0], args.start_timeout)
            wait_serving(address, procs[1], args.start_timeout)
            with grpc.insecure_channel(address) as channel:
                limit = stats_pb2_grpc.StatsServiceStub(channel).GetStats(
                    stats_pb2.GetStatsRequest(), timeout=5).pool.max_prompt_tokens
            print(f"ready: kvhandoff serving at {address} (prefill at {prefill_address}); "
                  f"max prompt {limit} tokens; prefill pool {_pool_line(prefill_address)}, "
                  f"decode pool {_pool_line(address)}"
                  + (f"; {DEMO_NOTE}" if args.model == "demo" else ""), flush=True)
            while not stopping and all(proc.poll() is None for proc in procs):
                time.sleep(0.2)
            failed = [i for i, proc in enumerate(procs) if proc.poll() not in (None, 0)]
            if failed and not stopping:
                i = failed[0]
                print(f"kvhandoff up: {children[i].role} exited with status "
                      f"{procs[i].returncode}: {children[i].why()}", file=sys.stderr)
                return 1
            return 0
        except (RuntimeError, TimeoutError) as err:
            # procs and children grow together; blame the child that exited, else the last
            i = next((i for i, proc in enumerate(procs) if proc.poll() not in (None, 0)),
                     len(procs) - 1)
            print(f"kvhandoff up: {_failed(children[i], procs[i], err)}", file=sys.stderr)
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
