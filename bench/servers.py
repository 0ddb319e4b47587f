"""Services for a benchmark: the disaggregated pair (prefill + decode) or one decode with
--local-prefill, each service its own process on 127.0.0.1 (as `kvhandoff up` starts them),
stopped with SIGTERM. Logs go to files in the run's work directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvhandoff_cli.up import wait_port_file, wait_serving

REPO = Path(__file__).resolve().parents[1]
MODES = ("disaggregated", "local")


@dataclass
class Deployment:
    """Running services of one mode; `address` is decode's, the client-facing one."""

    mode: str
    address: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def service_env(torch_threads: int) -> dict[str, str]:
    """The services' environment; torch_threads > 0 pins their intra-op threads (on a small
    shared machine, more threads than free cores make every parallel op wait for a timeslice)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if torch_threads > 0:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(torch_threads)
    return env


def _start(role: str, flags: list[str], workdir: Path, env: dict, timeout: float
           ) -> tuple[subprocess.Popen, str]:
    port_file = workdir / f"{role}.port"
    port_file.unlink(missing_ok=True)
    log = (workdir / f"{role}.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "kvhandoff_cli.main", role, "--port", "0",
                             "--port-file", str(port_file), *flags],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        return proc, f"127.0.0.1:{wait_port_file(port_file, proc, timeout)}"
    except Exception as err:
        proc.kill()
        tail = (workdir / f"{role}.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{role} did not start: {err}\n{tail}") from err


def start_deployment(mode: str, service_flags: list[str], workdir: Path, torch_threads: int,
                     decode_flags: list[str] = (), timeout: float = 300.0) -> Deployment:
    """Starts `mode` ('disaggregated' or 'local') and waits until decode reports SERVING."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: choose one of {', '.join(MODES)}")
    workdir = workdir / mode
    workdir.mkdir(parents=True, exist_ok=True)
    env = service_env(torch_threads)
    deployment = Deployment(mode, "")
    try:
        decode_extra = list(decode_flags)
        if mode == "disaggregated":
            prefill, prefill_address = _start("prefill", service_flags, workdir, env, timeout)
            deployment.procs.append(prefill)
            wait_serving(prefill_address, prefill, timeout)
            decode_extra += ["--prefill", prefill_address]
        else:
            decode_extra += ["--local-prefill"]
        decode, address = _start("decode", [*service_flags, *decode_extra], workdir, env, timeout)
        deployment.procs.append(decode)
        deployment.address = address
        wait_serving(address, decode, timeout)
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
