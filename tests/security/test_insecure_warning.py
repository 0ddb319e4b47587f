"""`insecure_handoff` warns where KV would cross a network in clear text: prefill when it listens
off loopback without certificates, decode when the prefill it dials is off loopback without
certificates. Decode's own bind host is not the handoff (that is the API's warning)."""

from __future__ import annotations

import pytest

from common.config import DecodeConfig, ServiceConfig
from decode_svc.server import handoff_in_clear_text

from tests.isolation.launch import start
from tests.security.secure_cluster import MODEL_FLAGS, Pki, wait_log

pytestmark = pytest.mark.slow

REMOTE_PREFILL = "192.0.2.1:1"  # TEST-NET-1: only ever parsed here, never dialled
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


@pytest.mark.parametrize(("target", "certificates", "local", "warns"), [
    (REMOTE_PREFILL, False, False, True), (REMOTE_PREFILL, True, False, False),
    (REMOTE_PREFILL, False, True, False), (LOOPBACK_PREFILL, False, False, False)],
    ids=["remote-prefill-plaintext", "remote-prefill-mtls", "local-prefill", "loopback-prefill"])
def test_decode_judges_the_prefill_target_not_its_own_bind(target, certificates, local, warns):
    """The rule itself, without a process: a decode started with a remote --prefill would dial
    it, and tests never send traffic off loopback."""
    tls = {"tls_cert": "c.pem", "tls_key": "k.pem", "tls_ca": "ca.pem"} if certificates else {}
    config = DecodeConfig(ServiceConfig(host="0.0.0.0", **tls), prefill_target=target,
                          local_prefill=local)
    assert handoff_in_clear_text(config) == warns


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1"], ids=["public-bind", "loopback-bind"])
def test_decode_with_a_loopback_prefill_does_not_warn(tmp_path, host):
    flags = [*MODEL_FLAGS, "--host", host, "--prefill", LOOPBACK_PREFILL]
    service = start("decode", tmp_path, flags, wait_healthy=False)
    assert not _warned(service, "listening"), service.log_text()[-2000:]
