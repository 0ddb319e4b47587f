"""`kvhandoff up`: a local cluster, prefill and decode as separate processes on loopback."""

from __future__ import annotations

import argparse
import collections
import json
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

from common.pb.kvhandoff.v1 import stats_pb2, stats_pb2_grpc
from common.server.cpu_placement import (CpuListError, allowed_cpus, check_cpu_affinity,
                                         format_cpu_list, split_cores)
from common.server.launch import ServiceProcess, launch, stop_processes
from common.server.wait import wait_serving
from common.server.ports import PortUnavailable, check_port_free
from kvhandoff_cli.arguments import HelpFormatter

DEMO_NOTE = ("model 'demo': random weights, so its text is noise by design; its tokenizer has "
             "98 ids (<bos>, <eos>, one per printable ASCII character and newline); --model DIR "
             "serves a Hugging Face checkpoint directory (Llama, Mistral, Qwen2, Qwen3)")


class ChildStderr:
    """Copies a child's stderr to ours line by line and keeps the last lines, so that `up` can
    say why a child failed (its refusal is a line starting with `kvhandoff ROLE:`, which is
    kept for up's own line and not copied, so it is printed once), and the /metrics port the
    child logged (`metrics_port`, -1 when off or not yet known)."""

    def __init__(self, role: str, proc: subprocess.Popen) -> None:
        self.role = role
        self.proc = proc
        self.lines: collections.deque[str] = collections.deque(maxlen=50)
        self.metrics_port = -1
        self.http_port = -1  # decode's OpenAI-compatible API, as it logged it
        self._thread = threading.Thread(target=self._copy, args=(proc.stderr,), daemon=True)
        self._thread.start()

    def _copy(self, stream) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))
            if '"metrics_port"' in line:
                self.metrics_port = _logged_metrics_port(line, self.metrics_port)
                self.http_port = _logged_metrics_port(line, self.http_port, "http_port")
            if line.startswith(f"kvhandoff {self.role}:"):
                continue  # up says it, in the line that names the child
            sys.stderr.write(line)
            sys.stderr.flush()

    def why(self) -> str:
        self._thread.join(timeout=2)  # the child has exited: its last lines are on the way
        lines = [line for line in self.lines if line.strip()]
        own = [line for line in lines if line.startswith(f"kvhandoff {self.role}")]
        return (own or lines or ["(it wrote nothing to stderr)"])[-1]


def _logged_metrics_port(line: str, known: int, key: str = "metrics_port") -> int:
    try:
        return int(json.loads(line).get(key, known))
    except (ValueError, TypeError, AttributeError):
        return known


def _metrics_line(host: str, children: list[ChildStderr]) -> str:
    ports = {child.role: child.metrics_port for child in children}
    if all(port < 0 for port in ports.values()):
        return "metrics off (--metrics-port N serves them)"
    return "metrics " + ", ".join(f"http://{host}:{port}/metrics ({role})"
                                  for role, port in sorted(ports.items()) if port >= 0)


def _http_line(host: str, children: list[ChildStderr]) -> str:
    port = next((child.http_port for child in children if child.role == "decode"), -1)
    return f"; OpenAI-compatible API at http://{host}:{port}/v1" if port >= 0 else ""


def _failed(child: ChildStderr, proc: subprocess.Popen, err: Exception) -> str:
    """One line naming the child that failed and why."""
    if proc.poll() is None:
        return f"{child.role}: {err}"
    return f"{child.role} exited with status {proc.returncode} before serving: {child.why()}"


def _pool_line(address: str, metadata=()) -> str:
    with grpc.insecure_channel(address) as channel:
        pool = stats_pb2_grpc.StatsServiceStub(channel).GetStats(
            stats_pb2.GetStatsRequest(), timeout=5, metadata=metadata).pool
    return f"{pool.tokens_total} tokens"


def _plane_line(address: str, wanted: str) -> str:
    """The plane decode agreed on: the same choice (common.handoff.planes) from the same info,
    on the same host, with decode's defaults (no TLS, /dev/shm)."""
    from common.handoff.nixl_agent import nixl_available
    from common.handoff.planes import DEFAULT_SHM_DIR, choose_plane
    from common.pb.kvhandoff.v1 import handoff_pb2, handoff_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        info = handoff_pb2_grpc.HandoffServiceStub(channel).GetPrefillInfo(
            handoff_pb2.GetPrefillInfoRequest(), timeout=5)
    return choose_plane(info, wanted, DEFAULT_SHM_DIR, True, nixl_available()[0])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvhandoff up", formatter_class=HelpFormatter,
                                description="Start a local cluster, prefill and decode as two "
                                "processes on loopback, and print one 'ready' line with the "
                                "address once both are SERVING; Ctrl-C or SIGTERM stops both.")
    p.add_argument("--model", default="demo",
                   help="'demo' (built in, random weights) or a Hugging Face checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address both services bind")
    p.add_argument("--port", type=int, default=50051, help="client-facing (decode) port")
    p.add_argument("--http-port", type=int, default=-1,
                   help="decode's OpenAI-compatible HTTP API port (/v1/completions, "
                        "/v1/chat/completions, /v1/models; 0: a free one; -1: off)")
    p.add_argument("--prefill-port", type=int, default=0, help="prefill's port (0: a free one)")
    p.add_argument("--metrics-port", type=int,
                   default=int(os.environ.get("KVHANDOFF_METRICS_PORT") or -1),
                   help="decode's /metrics port; prefill's is the next one (0: free ones; -1: "
                        "off; $KVHANDOFF_METRICS_PORT when set)")
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
    p.add_argument("--prefill-chunk-tokens", type=int, default=None,
                   help="prefill's chunk: the most tokens of one prompt per forward pass "
                        "(none: prefill's own)")
    p.add_argument("--prefill-args", default="", help="extra flags for prefill, one string")
    p.add_argument("--decode-args", default="", help="extra flags for decode, one string")
    p.add_argument("--data-plane", default="auto",
                   choices=("auto", "inline", "shared-memory", "nixl"),
                   help="how KV travels; auto: the fastest plane both sides offer")
    p.add_argument("--cpu-split", action=argparse.BooleanOptionalAction, default=True,
                   help="give prefill and decode each its own share of the CPUs up may use "
                        "(prefill the lower half, decode the rest); --no-cpu-split: both use "
                        "all of them with torch's default threads")
    p.add_argument("--core-borrowing", action=argparse.BooleanOptionalAction, default=False,
                   help="with split CPUs, each service also computes on the other's CPUs while "
                        "the other idles (decode while no handoff is in flight, prefill while "
                        "decode has nothing running)")
    p.add_argument("--prefill-cpus", default="", metavar="LIST",
                   help="prefill's CPUs, e.g. 0-3 (empty: from --cpu-split)")
    p.add_argument("--decode-cpus", default="", metavar="LIST",
                   help="decode's CPUs, e.g. 4-7 (empty: from --cpu-split)")
    p.add_argument("--prefill-torch-threads", type=int, default=0,
                   help="prefill's torch threads (0: one per CPU of its share)")
    p.add_argument("--decode-torch-threads", type=int, default=0,
                   help="decode's torch threads (0: one per CPU of its share)")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill keeps prompt pages for later requests of the same cache scope "
                        "(identity and cache_salt; none shares with nobody)")
    p.add_argument("--api-tokens", type=Path, default=None, metavar="FILE",
                   help="decode's client API takes only the tokens of this file of 'TENANT "
                        "TOKEN' lines, each naming its tenant; SIGHUP to up reloads it")
    p.add_argument("--verify-full-fraction", default="0",
                   help="share of handoffs (0 to 1) decode audits by recomputing the whole "
                        "prompt (SPEC.md D-49)")
    p.add_argument("--start-timeout", type=float, default=300.0,
                   help="seconds each service may take to start")
    return p


def _chunk_flag(tokens: int | None) -> list[str]:
    return [] if tokens is None else ["--prefill-chunk-tokens", str(tokens)]


def cpu_placement(args: argparse.Namespace) -> dict[str, tuple[int, tuple[int, ...]]]:
    """role -> (torch threads, CPUs) from up's flags; CPUs () leave the service unpinned and
    threads 0 leave torch's default. Raises CpuListError on a list that cannot be used."""
    shares = split_cores(allowed_cpus()) if args.cpu_split else ((), ())
    placement = {}
    for role, share in zip(("prefill", "decode"), shares):
        text = getattr(args, f"{role}_cpus")
        threads = getattr(args, f"{role}_torch_threads")
        if threads < 0:
            raise CpuListError(f"--{role}-torch-threads must be >= 0, got {threads}")
        try:
            cpus = check_cpu_affinity(text) if text else share
        except CpuListError as err:
            raise CpuListError(f"--{role}-cpus: {err}") from err
        placement[role] = (threads or len(cpus), cpus)
    return placement


def _placement_flags(threads: int, cpus: tuple[int, ...]) -> list[str]:
    return ["--torch-threads", str(threads), "--cpu-affinity", format_cpu_list(cpus)]


PEER = {"prefill": "decode", "decode": "prefill"}
BORROW_WHEN = {"prefill": "while decode idles", "decode": "while no handoff is in flight"}


def borrowed_cpus(placement: dict[str, tuple[int, tuple[int, ...]]], role: str,
                  enabled: bool) -> tuple[int, ...]:
    """The peer's CPUs role may borrow (common/server/core_borrowing.py): none unless enabled
    and both services are pinned; never its own."""
    own, peer = placement[role][1], placement[PEER[role]][1]
    if not enabled or not own or not peer:
        return ()
    return tuple(c for c in peer if c not in own)


def _borrow_flags(cpus: tuple[int, ...], busy_file: Path) -> list[str]:
    return ["--borrow-cpus", format_cpu_list(cpus), "--busy-file", str(busy_file)] if cpus else []


def _placement_line(placement: dict[str, tuple[int, tuple[int, ...]]],
                    borrowing: dict[str, tuple[int, ...]]) -> str:
    def one(role: str) -> str:
        threads, cpus = placement[role]
        where = f"CPUs {format_cpu_list(cpus)}" if cpus else "all CPUs"
        line = f"{role} {where}, " + (f"{threads} torch threads" if threads
                                      else "torch's default threads")
        if borrowing[role]:
            line += (f" (+{len(borrowing[role])} on CPUs {format_cpu_list(borrowing[role])} "
                     f"{BORROW_WHEN[role]})")
        return line
    return f"{one('prefill')}; {one('decode')}"


def _fraction(text: str, flag: str) -> float:
    """A share in [0, 1] from the command line; ValueError names the flag and the value."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not a number in [0, 1]") from None
    if not 0.0 <= value <= 1.0:  # NaN fails this too
        raise ValueError(f"{flag} must be in [0, 1], got {text}")
    return value


def _metrics_ports(port: int) -> tuple[int, int]:
    """(prefill, decode) /metrics ports for up's --metrics-port."""
    return (port if port <= 0 else port + 1), port


def up(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    from kvhandoff_cli.up_checks import refusal

    if problem := refusal(args):  # before any child starts: said once, nothing loaded
        print(f"kvhandoff up: refusing to start: {problem}", file=sys.stderr)
        return 2
    try:
        audit_fraction = _fraction(args.verify_full_fraction, "--verify-full-fraction")
    except ValueError as err:
        print(f"kvhandoff up: refusing to start: {err}", file=sys.stderr)
        return 2
    from common.server.tenants import TenantsFileError, read_token_entries

    try:  # up's own calls to decode's StatsService need a token of the file
        bearer = (("authorization", f"Bearer {read_token_entries(args.api_tokens)[0].token}"),
                  ) if args.api_tokens else ()
    except TenantsFileError as err:
        print(f"kvhandoff up: refusing to start: {err}", file=sys.stderr)
        return 2
    try:
        placement = cpu_placement(args)
    except CpuListError as err:
        print(f"kvhandoff up: refusing to start: {err}", file=sys.stderr)
        return 2
    prefill_metrics, decode_metrics = _metrics_ports(args.metrics_port)
    try:
        for port, flag in ((args.port, "--port"), (args.prefill_port, "--prefill-port"),
                           (args.http_port, "--http-port"),
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
    from common.handoff.nixl_agent import LOOPBACK_UCX  # both services on this host: NIXL's
    for key, value in LOOPBACK_UCX.items():            # UCX stays on it unless told otherwise
        os.environ.setdefault(key, value)
    services: list[ServiceProcess] = []
    children: list[ChildStderr] = []
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    def watch(role: str):
        return lambda proc: children.append(ChildStderr(role, proc))

    decode_ready = False  # before that, decode has no SIGHUP handler yet: it would exit

    def reload_tokens(*_):
        for child in children:
            if decode_ready and child.role == "decode" and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGHUP)

    signal.signal(signal.SIGTERM, stop)
    if args.api_tokens:  # else decode has no file to reload: SIGHUP keeps its default
        signal.signal(signal.SIGHUP, reload_tokens)
    signal.signal(signal.SIGINT, stop)
    borrowing = {role: borrowed_cpus(placement, role, args.core_borrowing)
                 for role in ("prefill", "decode")}
    with tempfile.TemporaryDirectory() as tmp:
        busy_file = Path(tmp) / "decode.busy"
        try:
            services.append(launch(
                "prefill", [*cli, "prefill", *common, "--port", str(args.prefill_port),
                            "--pool-tokens", str(args.prefill_pool_tokens), "--metrics-port",
                            str(prefill_metrics), *_chunk_flag(args.prefill_chunk_tokens),
                            "--prefix-cache" if args.prefix_cache else "--no-prefix-cache",
                            *_placement_flags(*placement["prefill"]),
                            *_borrow_flags(borrowing["prefill"], busy_file),
                            *shlex.split(args.prefill_args)],
                Path(tmp) / "prefill.port", args.start_timeout, host=args.host,
                wait_until_serving=False, capture_stderr=True, on_start=watch("prefill")))
            prefill_address = services[0].address
            services.append(launch(
                "decode", [*cli, "decode", *common, "--port", str(args.port), "--prefill",
                           prefill_address, "--pool-tokens", str(args.decode_pool_tokens),
                           "--data-plane", args.data_plane, "--metrics-port", str(decode_metrics),
                           "--http-port", str(args.http_port),
                           "--verify-full-fraction", repr(audit_fraction),
                           *(["--api-tokens", str(args.api_tokens.resolve())]
                             if args.api_tokens else []),
                           *_placement_flags(*placement["decode"]),
                           *_borrow_flags(borrowing["decode"], busy_file),
                           *shlex.split(args.decode_args)],
                Path(tmp) / "decode.port", args.start_timeout, host=args.host,
                wait_until_serving=False, capture_stderr=True, on_start=watch("decode")))
            address = services[1].address
            for service in services:  # both warm up at once; each wait is for its own process
                wait_serving(service.address, args.start_timeout, proc=service.proc)
            with grpc.insecure_channel(address) as channel:
                limit = stats_pb2_grpc.StatsServiceStub(channel).GetStats(
                    stats_pb2.GetStatsRequest(), timeout=5,
                    metadata=bearer).pool.max_prompt_tokens
            print(f"ready: kvhandoff serving at {address} (prefill at {prefill_address}); "
                  f"max prompt {limit} tokens; prefill pool {_pool_line(prefill_address)}, "
                  f"decode pool {_pool_line(address, bearer)}; data plane "
                  f"{_plane_line(prefill_address, args.data_plane)}; "
                  f"{_placement_line(placement, borrowing)}; {_metrics_line(args.host, children)}"
                  f"{_http_line(args.host, children)}"
                  + (f"; {DEMO_NOTE}" if args.model == "demo" else ""), flush=True)
            decode_ready = True
            procs = [child.proc for child in children]
            while not stopping and all(proc.poll() is None for proc in procs):
                time.sleep(0.2)
            failed = [child for child in children if child.proc.poll() not in (None, 0)]
            if failed and not stopping:
                child = failed[0]
                print(f"kvhandoff up: {child.role} exited with status "
                      f"{child.proc.returncode}: {child.why()}", file=sys.stderr)
                return 1
            return 0
        except (RuntimeError, TimeoutError) as err:
            # blame the child that exited, else the last one started
            child = next((c for c in children if c.proc.poll() not in (None, 0)), children[-1])
            print(f"kvhandoff up: {_failed(child, child.proc, err)}", file=sys.stderr)
            return 1
        finally:
            stop_processes([child.proc for child in reversed(children)], timeout=15)
