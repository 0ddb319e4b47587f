"""Real service processes on 127.0.0.1 for tests: start, wait for SERVING, talk, stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvhandoff_cli.up import wait_port_file, wait_serving
from common.pb.kvhandoff.v1 import (generate_pb2, generate_pb2_grpc, handoff_pb2_grpc, stats_pb2,
                                    stats_pb2_grpc)

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 180.0


@dataclass
class Service:
    role: str
    proc: subprocess.Popen
    address: str
    log_path: Path

    def stats(self) -> stats_pb2.GetStatsResponse:
        with grpc.insecure_channel(self.address) as channel:
            return stats_pb2_grpc.StatsServiceStub(channel).GetStats(
                stats_pb2.GetStatsRequest(), timeout=10)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_service(role: str, workdir: Path, flags: list[str], env: dict | None = None,
                  wait_healthy: bool = True, module: str = "kvhandoff_cli.main", port: int = 0,
                  entry_args: list[str] | None = None) -> Service:
    """Starts `python -m module *entry_args --port PORT --port-file F *flags` in workdir
    (entry_args default to [role]: the real CLI) and waits for its port, then for SERVING."""
    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / f"{role}.port"
    port_file.unlink(missing_ok=True)
    log_path = workdir / f"{role}.log"
    full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *(entry_args or [role]), "--port", str(port),
             "--port-file", str(port_file), *flags],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    try:
        bound = wait_port_file(port_file, proc, START_TIMEOUT)
        service = Service(role, proc, f"127.0.0.1:{bound}", log_path)
        if wait_healthy:
            wait_serving(service.address, proc, START_TIMEOUT)
        return service
    except Exception as err:
        proc.kill()
        proc.wait()
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"{role} failed to start: {err}\n{tail}") from err


@dataclass
class Cluster:
    prefill: Service
    decode: Service
    extra: list[Service] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.decode.address

    def stop(self) -> None:
        for service in [self.decode, self.prefill, *self.extra]:
            service.stop()

    def assert_pools_at_baseline(self, timeout: float = 10.0) -> None:
        """Both pools fully free (polls briefly: releases are asynchronous)."""
        deadline = time.monotonic() + timeout
        while True:
            pools = [s.stats().pool for s in (self.prefill, self.decode)]
            if all(p.pages_free == p.pages_total for p in pools):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"pools not at baseline: {pools}")
            time.sleep(0.05)


def start_cluster(workdir: Path, model: str, prefill_flags: list[str] = (),
                  decode_flags: list[str] = (), common_flags: list[str] = (),
                  env: dict | None = None) -> Cluster:
    prefill = start_service("prefill", workdir,
                            ["--model", model, *common_flags, *prefill_flags], env)
    try:
        decode = start_service("decode", workdir, ["--model", model, "--prefill", prefill.address,
                                                   *common_flags, *decode_flags], env)
    except Exception:
        prefill.stop()
        raise
    return Cluster(prefill, decode)


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    finish_reason: int
    completion_tokens: int


def generate(address: str, token_ids: list[int] | None = None, text: str | None = None,
             max_tokens: int = 16, timeout: float | None = 120, **sampling) -> Generation:
    """Runs one Generate call to the end; raises grpc.RpcError on failure."""
    request = generate_pb2.GenerateRequest(max_tokens=max_tokens)
    if token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    else:
        request.text = text
    for key in ("temperature", "top_p", "top_k"):
        if key in sampling:
            setattr(request.sampling, key, sampling[key])
    if "seed" in sampling:
        request.sampling.seed = sampling["seed"]
        request.sampling.has_seed = True
    request.ignore_eos = sampling.get("ignore_eos", False)
    tokens: list[int] = []
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        for response in stub.Generate(request, timeout=timeout):
            if response.HasField("token"):
                tokens.append(response.token.token_id)
            else:
                return Generation(tokens, response.finished.finish_reason,
                                  response.finished.usage.completion_tokens)
    raise AssertionError(f"stream ended without a finished message after {tokens}")


def handoff_stub(channel: grpc.Channel) -> handoff_pb2_grpc.HandoffServiceStub:
    return handoff_pb2_grpc.HandoffServiceStub(channel)
