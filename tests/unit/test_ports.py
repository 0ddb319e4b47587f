"""A port that is taken is refused with its number, by gRPC servers and the /metrics endpoint,
whether a kvhandoff server or any other program holds it.

gRPC servers set SO_REUSEPORT by default: a second server on a taken port then binds without
error and the kernel splits connections between the two (a second `kvhandoff up` printed ready
and took half of the traffic)."""

from __future__ import annotations

import socket

import grpc
import pytest

from common.metrics import ServiceMetrics
from common.server.grpc_server import create_server
from common.server.ports import PortUnavailable, check_port_free


def no_services(server: grpc.aio.Server) -> list[str]:
    return []


def plain_listener() -> socket.socket:
    """A listening socket that is not gRPC (no SO_REUSEPORT)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


async def test_a_second_grpc_server_on_a_taken_port_is_refused():
    first, port, _state = await create_server(no_services, "127.0.0.1", 0, None, 1 << 20)
    try:
        with pytest.raises(PortUnavailable) as err:
            second, *_ = await create_server(no_services, "127.0.0.1", port, None, 1 << 20)
            await second.stop(0)  # only reached when the bug is back
        assert f"port {port}" in str(err.value) and "--port" in str(err.value)
    finally:
        await first.stop(0)


async def test_a_port_held_by_another_program_is_refused():
    with plain_listener() as sock:
        port = sock.getsockname()[1]
        with pytest.raises(PortUnavailable, match=f"port {port} on 127.0.0.1"):
            await create_server(no_services, "127.0.0.1", port, None, 1 << 20,
                                port_setting="--prefill-port")


async def test_servers_do_not_share_ports_even_when_the_probe_is_skipped(monkeypatch):
    """The bind itself refuses (grpc.so_reuseport 0), not only the probe before it."""
    monkeypatch.setattr("common.server.grpc_server.check_port_free", lambda *args: None)
    first, port, _state = await create_server(no_services, "127.0.0.1", 0, None, 1 << 20)
    try:
        with pytest.raises(PortUnavailable, match=f"port {port}"):
            second, *_ = await create_server(no_services, "127.0.0.1", port, None, 1 << 20)
            await second.stop(0)
    finally:
        await first.stop(0)


def test_a_taken_metrics_port_is_refused():
    metrics = ServiceMetrics("decode", lambda: 1, lambda: 1, lambda: 0, lambda: 0)
    with plain_listener() as sock:
        port = sock.getsockname()[1]
        with pytest.raises(PortUnavailable, match=f"port {port} .*--metrics-port"):
            metrics.serve_http("127.0.0.1", port)
    taken = metrics.serve_http("127.0.0.1", 0)
    other = ServiceMetrics("prefill", lambda: 1, lambda: 1, lambda: 0, lambda: 0)
    with pytest.raises(PortUnavailable, match=f"port {taken}"):
        other.serve_http("127.0.0.1", taken)


def test_port_zero_and_free_ports_pass_the_check():
    check_port_free("127.0.0.1", 0, "--port")
    with plain_listener() as sock:
        port = sock.getsockname()[1]
    check_port_free("127.0.0.1", port, "--port")  # closed again: free


def test_an_unresolvable_host_is_named():
    with pytest.raises(PortUnavailable, match="no-such-host.invalid"):
        check_port_free("no-such-host.invalid", 50051, "--port")
