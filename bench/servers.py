"""Services for a benchmark: the disaggregated pair (prefill + decode) or one decode with
--local-prefill, each service its own process on 127.0.0.1 (as `kvhandoff up` starts them),
stopped with SIGTERM. Logs go to files in the run's work directory."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.server.launch import ServiceProcess, launch, stop_processes

REPO = Path(__file__).resolve().parents[1]
MODES = ("disaggregated", "local", "cache-off", "cache-on")
# disaggregated modes whose prefill runs with these flags (the prefix cache off and on)
PREFILL_FLAGS = {"disaggregated": [], "cache-off": ["--no-prefix-cache"],
                 "cache-on": ["--prefix-cache"]}


@dataclass
class Deployment:
    """Running services of one mode; `address` is decode's, the client-facing one."""

    mode: str
    address: str
    services: list[ServiceProcess] = field(default_factory=list)

    def stop(self) -> None:
        stop_processes([service.proc for service in reversed(self.services)])


def service_env(torch_threads: int) -> dict[str, str]:
    """The services' environment; torch_threads > 0 pins their intra-op threads (on a small
    shared machine, more threads than free cores make every parallel op wait for a timeslice)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if torch_threads > 0:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(torch_threads)
    return env


def _start(role: str, flags: list[str], workdir: Path, env: dict, timeout: float
           ) -> ServiceProcess:
    return launch(role, [sys.executable, "-m", "kvhandoff_cli.main", role, "--port", "0", *flags],
                  workdir / f"{role}.port", timeout, log_path=workdir / f"{role}.log", cwd=REPO,
                  env=env)


def start_deployment(mode: str, service_flags: list[str], workdir: Path, torch_threads: int,
                     decode_flags: list[str] = (), timeout: float = 300.0) -> Deployment:
    """Starts `mode` (one of MODES: 'local' is decode --local-prefill, the others a prefill
    and a decode) and waits until decode reports SERVING."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: choose one of {', '.join(MODES)}")
    workdir = workdir / mode
    workdir.mkdir(parents=True, exist_ok=True)
    env = service_env(torch_threads)
    deployment = Deployment(mode, "")
    try:
        decode_extra = list(decode_flags)
        if mode in PREFILL_FLAGS:
            prefill = _start("prefill", [*service_flags, *PREFILL_FLAGS[mode]], workdir, env,
                             timeout)
            deployment.services.append(prefill)
            decode_extra += ["--prefill", prefill.address]
        else:
            decode_extra += ["--local-prefill"]
        decode = _start("decode", [*service_flags, *decode_extra], workdir, env, timeout)
        deployment.services.append(decode)
        deployment.address = decode.address
        return deployment
    except BaseException:
        deployment.stop()
        raise


def model_vocab_size(model: str) -> int:
    """The vocabulary of --model without loading its weights."""
    if model == "demo":
        from common.tokenizer import CharTokenizer

        return CharTokenizer().vocab_size
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
