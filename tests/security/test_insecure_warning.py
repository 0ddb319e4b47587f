"""A service bound to a non-loopback address without certificates says so in its log
(`insecure_handoff`); with certificates, or on loopback, it does not."""

from __future__ import annotations

import pytest

from tests.isolation.launch import start
from tests.security.secure_cluster import MODEL_FLAGS, Pki, wait_log

pytestmark = pytest.mark.slow

UNREACHABLE_PREFILL = "127.0.0.1:1"  # decode logs at start whether or not prefill answers


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return Pki.create(tmp_path_factory.mktemp("pki"))


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("host, certificates, warns", [
    ("0.0.0.0", False, True), ("0.0.0.0", True, False), ("127.0.0.1", False, False)],
    ids=["public-plaintext", "public-mtls", "loopback-plaintext"])
def test_insecure_handoff_warning(tmp_path, pki, role, host, certificates, warns):
    identity = pki.prefill if role == "prefill" else pki.decode
    flags = [*MODEL_FLAGS, "--host", host, *(identity.flags() if certificates else [])]
    if role == "decode":
        flags += ["--prefill", UNREACHABLE_PREFILL]
    service = start(role, tmp_path, flags, wait_healthy=False)
    try:
        log = wait_log(service.log_path, '"listening"' if role == "decode" else '"serving"',
                       service.proc)
        assert ('"insecure_handoff"' in log) == warns, log[-2000:]
    finally:
        service.stop()
