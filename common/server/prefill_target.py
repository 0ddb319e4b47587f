"""Decode's --prefill target: a comma-separated list of HOST:PORT, each a prefill replica, or a
DNS name standing for every address it resolves to (decode_svc/prefill_replicas.py). Parsed
here, with no heavy imports, so the CLI refuses a bad value in one line before starting."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    host: str
    port: str
    resolve: bool  # a DNS name other than localhost


def parse_target(target: str) -> list[Entry]:
    """'h:p,h:p' (an 'ipv4:'/'ipv6:'/'dns:///' prefix is accepted) -> entries; ValueError
    names the entry that is not host:port."""
    rest = target.strip()
    for scheme in ("dns:///", "ipv4:", "ipv6:"):
        rest = rest.removeprefix(scheme)
    entries = []
    for raw in rest.split(","):
        raw = raw.strip()
        host, sep, port = raw.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"prefill target entry {raw!r} is not HOST:PORT (in {target!r})")
        bare = host.strip("[]")
        entries.append(Entry(host, port, resolve=not (_is_ip(bare) or bare == "localhost")))
    return entries


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
