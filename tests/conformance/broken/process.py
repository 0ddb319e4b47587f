"""Starting a broken variant as a real process, like tests/helpers/cluster.start_service does
for the real services (same port file, log and health wait; a different entry module)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from common.cli.up import wait_port_file, wait_serving
from tests.helpers.cluster import REPO, START_TIMEOUT, Service


def free_port() -> int:
    """A port that was free a moment ago (the caller binds it right away)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_variant(variant: str, role: str, workdir: Path, flags: list[str],
                  wait_healthy: bool = True) -> Service:
    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / f"{role}.port"
    port_file.unlink(missing_ok=True)
    log_path = workdir / f"{role}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.conformance.broken.run", variant, role, "--port", "0",
             "--port-file", str(port_file), *flags], cwd=REPO, stdout=log,
            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        port = wait_port_file(port_file, proc, START_TIMEOUT)
        service = Service(role, proc, f"127.0.0.1:{port}", log_path)
        if wait_healthy:
            wait_serving(service.address, proc, START_TIMEOUT)
        return service
    except Exception as err:
        proc.kill()
        raise RuntimeError(f"{variant} failed to start: {err}\n{log_path.read_text()[-3000:]}"
                           ) from err
