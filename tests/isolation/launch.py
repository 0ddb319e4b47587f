"""Starts a service process from any module that takes the `kvhandoff` arguments (the real
CLI, or tests.isolation.patched_service), as tests.helpers.cluster.start_service does."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.cluster import Service, start_service

PATCHED = "tests.isolation.patched_service"


def start(role: str, workdir: Path, flags: list[str], env: dict | None = None,
          module: str = "kvhandoff_cli.main", port: int = 0, wait_healthy: bool = True) -> Service:
    """Starts role from module in workdir (port and log files there); waits until SERVING."""
    return start_service(role, workdir, flags, env, wait_healthy, module=module, port=port)
