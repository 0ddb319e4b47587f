"""Ports a service is about to listen on: refuse, with the port named, when one is taken.

gRPC servers set SO_REUSEPORT by default, so a second server on a port that a first one holds
binds without error and the kernel then splits new connections between them: two clusters
answering one client at random. kvhandoff servers therefore turn the option off
(`grpc.so_reuseport` 0), and check each port first with a plain socket bound the way a
listener binds (SO_REUSEADDR, no SO_REUSEPORT), so a port held by anything, gRPC or not, is
refused before the model is loaded.
"""

from __future__ import annotations

import errno
import socket


class PortUnavailable(OSError):
    """A port a service was told to listen on cannot be bound; the message names it, says
    which setting chose it and what to do."""


def check_port_free(host: str, port: int, setting: str) -> None:
    """Raises PortUnavailable when host:port cannot be bound now (port 0 is always free).

    setting names the flag that chose the port (for the message), e.g. "--port"."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise PortUnavailable(f"cannot listen on {host}:{port} ({setting}): host {host!r} "
                              f"does not resolve: {err.strerror}") from err
    family, kind, proto, _name, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as err:
            raise port_error(host, port, setting, err) from err


def port_error(host: str, port: int, setting: str, err: OSError | None) -> PortUnavailable:
    """The refusal for a bind of host:port that failed with err (None: reason unknown)."""
    if err is None or err.errno == errno.EADDRINUSE:
        return PortUnavailable(
            f"port {port} on {host} ({setting}) is already in use by another program (perhaps "
            f"another kvhandoff); stop it or choose another port with {setting}")
    return PortUnavailable(f"cannot listen on {host}:{port} ({setting}): "
                           f"{err.strerror or err}")
