"""Starts a service process from any module that takes the `kvhandoff` arguments (the real
CLI, or tests.isolation.patched_service), as tests.helpers.cluster.start_service does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from common.cli.up import wait_port_file, wait_serving
from tests.helpers.cluster import REPO, START_TIMEOUT, Service

PATCHED = "tests.isolation.patched_service"


def start(role: str, workdir: Path, flags: list[str], env: dict | None = None,
          module: str = "common.cli.main", port: int = 0, wait_healthy: bool = True) -> Service:
    """Starts role from module in workdir (port and log files there); waits until SERVING."""
    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / f"{role}.port"
    port_file.unlink(missing_ok=True)
    log_path = workdir / f"{role}.log"
    full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, role, *flags, "--port", str(port), "--port-file",
             str(port_file)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=full_env)
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
