"""Which bind hosts and gRPC targets stay on this machine (the insecure_handoff warning)."""

from __future__ import annotations

import pytest

from common.server.loopback import is_loopback_host, is_loopback_target


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True), ("::1", True),
    ("[::1]", True), ("0.0.0.0", False), ("10.0.0.5", False), ("::", False),
    ("prefill", False), ("example.com", False)])
def test_loopback_hosts(host, loopback):
    assert is_loopback_host(host) is loopback


@pytest.mark.parametrize(("target", "loopback"), [
    ("127.0.0.1:50061", True), ("localhost:50061", True), ("[::1]:50061", True),
    ("dns:///localhost:50061", True), ("ipv4:127.0.0.1:1,127.0.0.1:2", True),
    ("ipv6:[::1]:50061", True), ("unix:/tmp/prefill.sock", True),
    ("10.1.2.3:50061", False), ("prefill:50061", False), ("dns:///prefill:50061", False),
    ("dns://8.8.8.8/prefill:50061", False), ("ipv4:127.0.0.1:1,10.0.0.2:2", False)])
def test_loopback_targets(target, loopback):
    assert is_loopback_target(target) is loopback
