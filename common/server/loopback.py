"""Whether an address stays on this machine: a bind host, or a gRPC target (what decode dials
to reach prefill), so that a service can warn when KV would cross a network in clear text."""

from __future__ import annotations

import ipaddress

LOCAL_SCHEMES = ("unix:", "unix-abstract:")


def is_loopback_host(host: str) -> bool:
    """'localhost', or a literal IPv4/IPv6 loopback address (127.0.0.0/8, ::1)."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a DNS name: it may resolve anywhere


def target_hosts(target: str) -> list[str]:
    """The hosts a gRPC target names: 'h:p', 'dns:///h:p', 'ipv4:a:p,b:p', 'ipv6:[::1]:p'."""
    rest = target
    for scheme in ("dns:", "ipv4:", "ipv6:"):
        if rest.startswith(scheme):
            rest = rest[len(scheme):]
            break
    rest = rest.removeprefix("//")
    if "/" in rest:  # dns://authority/host:port: the host is after the authority
        rest = rest.split("/", 1)[1]
    hosts = []
    for address in rest.split(","):
        address = address.strip()
        if address.startswith("["):
            hosts.append(address[1:address.find("]")])
        elif address.count(":") == 1:
            hosts.append(address.rsplit(":", 1)[0])
        else:  # no port, or a bare IPv6 address
            hosts.append(address)
    return hosts


def is_loopback_target(target: str) -> bool:
    """True when every address of the target is on this machine (loopback or a unix socket)."""
    if target.startswith(LOCAL_SCHEMES):
        return True
    hosts = target_hosts(target)
    return bool(hosts) and all(is_loopback_host(host) for host in hosts)
