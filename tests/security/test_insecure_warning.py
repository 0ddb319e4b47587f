"""`insecure_handoff` warns where KV would cross a network in clear text: prefill when it listens
off loopback without certificates, decode when the prefill it dials is off loopback without
certificates. Decode's own bind host is not the handoff (that is the API's warning)."""

from __future__ import annotations

import pytest

from tests.isolation.launch import start
from tests.security.secure_cluster import MODEL_FLAGS, Pki, wait_log

pytestmark = pytest.mark.slow

REMOTE_PREFILL = "192.0.2.1:1"  # TEST-NET-1: never reached; decode logs at start regardless
LOOPBACK_PREFILL = "127.0.0.1:1"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return Pki.create(tmp_path_factory.mktemp("pki"))


def _warned(service, ready_event: str) -> bool:
    try:
        log = wait_log(service.log_path, f'"{ready_event}"', service.proc)
    finally:
        service.stop()
    return '"insecure_handoff"' in log


@pytest.mark.parametrize(("host", "certificates", "warns"), [
    ("0.0.0.0", False, True), ("0.0.0.0", True, False), ("127.0.0.1", False, False)],
    ids=["public-plaintext", "public-mtls", "loopback-plaintext"])
def test_prefill_warns_when_it_listens_off_loopback_without_tls(tmp_path, pki, host,
                                                                 certificates, warns):
    flags = [*MODEL_FLAGS, "--host", host, *(pki.prefill.flags() if certificates else [])]
    service = start("prefill", tmp_path, flags, wait_healthy=False)
    assert _warned(service, "serving") == warns, service.log_text()[-2000:]


@pytest.mark.parametrize(("target", "host", "certificates", "warns"), [
    (REMOTE_PREFILL, "127.0.0.1", False, True), (REMOTE_PREFILL, "127.0.0.1", True, False),
    (LOOPBACK_PREFILL, "0.0.0.0", False, False), (LOOPBACK_PREFILL, "127.0.0.1", False, False)],
    ids=["remote-prefill-plaintext", "remote-prefill-mtls", "loopback-prefill-public-bind",
         "loopback-prefill"])
def test_decode_warns_when_its_prefill_is_off_loopback_without_tls(tmp_path, pki, target, host,
                                                                   certificates, warns):
    flags = [*MODEL_FLAGS, "--host", host, "--prefill", target,
             *(pki.decode.flags() if certificates else [])]
    service = start("decode", tmp_path, flags, wait_healthy=False)
    assert _warned(service, "listening") == warns, service.log_text()[-2000:]
