"""Real service processes on 127.0.0.1 for tests: start, wait for SERVING, talk, stop."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from common.pb.kvhandoff.v1 import (generate_pb2, generate_pb2_grpc, handoff_pb2_grpc, stats_pb2,
                                    stats_pb2_grpc)
from common.server.launch import ServiceProcess, launch
from tests.helpers.polling import wait_until

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 180.0


class Service(ServiceProcess):
    """A service process started for a test (it logs to a file in the test's workdir)."""

    def stats(self) -> stats_pb2.GetStatsResponse:
        with grpc.insecure_channel(self.address) as channel:
            return stats_pb2_grpc.StatsServiceStub(channel).GetStats(
                stats_pb2.GetStatsRequest(), timeout=10)


def start_service(role: str, workdir: Path, flags: list[str], env: dict | None = None,
                  wait_healthy: bool = True, module: str = "kvhandoff_cli.main", port: int = 0,
                  entry_args: list[str] | None = None) -> Service:
    """Starts `python -m module *entry_args --port PORT *flags` in workdir (entry_args default
    to [role]: the real CLI) through the shared launcher, and waits for its port, then (when
    wait_healthy) for SERVING."""
    workdir.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    started = launch(role, [sys.executable, "-m", module, *(entry_args or [role]), "--port",
                            str(port), *flags],
                     workdir / f"{role}.port", START_TIMEOUT, wait_until_serving=wait_healthy,
                     log_path=workdir / f"{role}.log", cwd=REPO, env=full_env)
    return Service(started.role, started.proc, started.address, started.log_path)


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
        def pools() -> list:
            return [service.stats().pool for service in (self.prefill, self.decode)]

        wait_until(lambda: all(p.pages_free == p.pages_total for p in pools()), timeout,
                   lambda: f"pools back at baseline: {pools()}")


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
    text: str = ""  # the streamed tokens' text pieces, joined


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
    pieces: list[str] = []
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        for response in stub.Generate(request, timeout=timeout):
            if response.HasField("token"):
                tokens.append(response.token.token_id)
                pieces.append(response.token.text)
            else:
                return Generation(tokens, response.finished.finish_reason,
                                  response.finished.usage.completion_tokens, "".join(pieces))
    raise AssertionError(f"stream ended without a finished message after {tokens}")


def handoff_stub(channel: grpc.Channel) -> handoff_pb2_grpc.HandoffServiceStub:
    return handoff_pb2_grpc.HandoffServiceStub(channel)
