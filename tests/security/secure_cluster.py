"""Certificates for a test cluster and waiting on services whose ports speak TLS.

The cluster CA signs prefill's and decode's identities (the handoff channel, mutual TLS) and
the certificate of decode's client-facing API; a second, unrelated CA signs an intruder."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.server.wait import wait_serving
from tests.helpers.cluster import START_TIMEOUT, Service, start_service
from tests.helpers.polling import wait_until
from tests.helpers.tls import CertificateAuthority, Identity

MODEL_FLAGS = ["--model", "demo", "--pool-tokens", "2048", "--max-context-tokens", "512",
               "--page-size", "16"]
TOKEN = "s3cret-test-token"


@dataclass(frozen=True)
class Pki:
    prefill: Identity
    decode: Identity
    api: Identity
    intruder: Identity  # signed by another CA that the cluster does not trust

    @classmethod
    def create(cls, root: Path) -> Pki:
        cluster = CertificateAuthority.create(root / "cluster", "cluster-ca")
        rogue = CertificateAuthority.create(root / "rogue", "rogue-ca")
        intruder = rogue.issue("intruder")
        return cls(cluster.issue("prefill"), cluster.issue("decode"), cluster.issue("api"),
                   # the intruder trusts the cluster CA (it knows whom it talks to) but its own
                   # certificate is signed by the rogue CA
                   Identity(intruder.cert, intruder.key, cluster.cert))


def health_status(channel: grpc.Channel, metadata=None) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=2.0, metadata=metadata).status


def wait_log(path: Path, text: str, proc: subprocess.Popen, timeout: float = 120.0) -> str:
    """Returns the log once it contains text (the service logs asynchronously); fails at once
    when the process exits first."""
    def logged() -> bool:
        if text in path.read_text(errors="replace"):
            return True
        assert proc.poll() is None, (f"exited with {proc.returncode} before logging {text!r}:\n"
                                     f"{path.read_text(errors='replace')[-3000:]}")
        return False

    wait_until(logged, timeout, f"{text!r} in {path}")
    return path.read_text(errors="replace")


def start_secure_prefill(pki: Pki, workdir: Path) -> Service:
    """A prefill that requires client certificates signed by the cluster CA; returns once it
    reports SERVING over mutual TLS (stopped again if it never does)."""
    prefill = start_service("prefill", workdir, [*MODEL_FLAGS, *pki.prefill.flags()],
                            wait_healthy=False)
    try:
        wait_serving(prefill.address, START_TIMEOUT, credentials=pki.decode.channel_credentials(),
                     proc=prefill.proc)
    except BaseException:
        prefill.stop()
        raise
    return prefill
