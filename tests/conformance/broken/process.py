"""Starting a broken variant as a real process, like tests/helpers/cluster.start_service does
for the real services (same port file, log and health wait; a different entry module)."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.helpers.cluster import Service, start_service


def free_port() -> int:
    """A port that was free a moment ago (the caller binds it right away)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_variant(variant: str, role: str, workdir: Path, flags: list[str],
                  wait_healthy: bool = True) -> Service:
    return start_service(role, workdir, flags, wait_healthy=wait_healthy,
                         module="tests.conformance.broken.run", entry_args=[variant, role])
