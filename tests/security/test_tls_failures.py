"""A TLS mistake is said as one: the CLI (`kvhandoff health`, `kvhandoff generate`) and decode's
log name TLS and the likely cause, never "UNREACHABLE (UNAVAILABLE)" or a bare
DEADLINE_EXCEEDED (issue 26 item 5).

The four mistakes of a two-host setup, each with certificates made here, on loopback: a CA
that did not sign the server's certificate, a server certificate whose SANs do not list the
name dialled (DNS:prefill.example dialled as 127.0.0.1), no client certificate where the
server requires one, and a client certificate of a CA the server does not trust. The CLI cases
dial an in-process TLS health server (seconds); decode's cases start real prefills and
decodes (slow)."""

from __future__ import annotations

import concurrent.futures
import json
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.server.tls_diagnosis import DialSide, TlsCause, diagnose
from tests.e2e.test_cli_errors import one_line, run
from tests.helpers.cluster import START_TIMEOUT, Service, start_service
from tests.helpers.polling import wait_until
from tests.helpers.tls import CertificateAuthority, Identity
from tests.security.secure_cluster import MODEL_FLAGS, wait_log

OTHER_NAME = "prefill.example"
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass(frozen=True)
class Certs:
    server: Identity  # SANs 127.0.0.1 and localhost, cluster CA
    elsewhere: Identity  # SAN DNS:prefill.example only, cluster CA
    client: Identity  # cluster CA
    intruder: Identity  # signed by the rogue CA; trusts the cluster CA
    rogue_ca: Path


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    root = tmp_path_factory.mktemp("tls-failures")
    cluster = CertificateAuthority.create(root / "cluster", "cluster-ca")
    rogue = CertificateAuthority.create(root / "rogue", "rogue-ca")
    intruder = rogue.issue("intruder")
    return Certs(cluster.issue("server"), cluster.issue("elsewhere", f"DNS:{OTHER_NAME}"),
                 cluster.issue("client"), Identity(intruder.cert, intruder.key, cluster.cert),
                 rogue.cert)


def _serve(identity: Identity, require_client_cert: bool) -> tuple[grpc.Server, str]:
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    creds = grpc.ssl_server_credentials(
        [(identity.key.read_bytes(), identity.cert.read_bytes())],
        root_certificates=identity.ca.read_bytes() if require_client_cert else None,
        require_client_auth=require_client_cert)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def servers(certs):
    """name -> address: mtls (requires cluster client certificates, like prefill), mtls_elsewhere
    (the same with the DNS:prefill.example certificate), tls_elsewhere (TLS only, like
    decode's client API)."""
    started = {"mtls": _serve(certs.server, True),
               "mtls_elsewhere": _serve(certs.elsewhere, True),
               "tls_elsewhere": _serve(certs.elsewhere, False)}
    yield {name: address for name, (_, address) in started.items()}
    for server, _ in started.values():
        server.stop(0)


def _health(certs: Certs, target: str, *, ca: Path | None = None,
            client: Identity | None = None, server_name: str = ""
            ) -> tuple[int, str]:
    flags = ["--tls-ca", str(ca or certs.server.ca)]
    if client is not None:
        flags += ["--tls-cert", str(client.cert), "--tls-key", str(client.key)]
    if server_name:
        flags += ["--server-name", server_name]
    result = run("health", target, *flags)
    code = 0 if result.returncode == 0 else 1
    return code, one_line(result, code, "stdout")


def test_the_right_certificates_are_served(certs, servers):
    code, line = _health(certs, servers["mtls"], client=certs.client)
    assert (code, line) == (0, f"{servers['mtls']} (server) SERVING"), line
    code, line = _health(certs, servers["mtls_elsewhere"], client=certs.client,
                         server_name=OTHER_NAME)
    assert code == 0 and line.endswith("SERVING"), line  # the fix the SAN message names


@pytest.mark.parametrize("mistake, cause, says", [
    ("wrong_ca", TlsCause.UNTRUSTED_SERVER, "is not signed by the CA in --tls-ca"),
    ("no_client_certificate", TlsCause.CLIENT_CERTIFICATE, "requires a client certificate"),
    ("client_certificate_of_another_ca", TlsCause.CLIENT_CERTIFICATE,
     "does not trust our client certificate"),
    ("san_mismatch", TlsCause.NAME_MISMATCH, "does not list '127.0.0.1' in its subjectAltName"),
])
def test_health_names_the_tls_mistake(certs, servers, mistake, cause, says):
    target = servers["mtls_elsewhere" if mistake == "san_mismatch" else "mtls"]
    kwargs = {"wrong_ca": {"ca": certs.rogue_ca, "client": certs.client},
              "no_client_certificate": {},
              "client_certificate_of_another_ca": {"client": certs.intruder},
              "san_mismatch": {"client": certs.client}}[mistake]
    code, line = _health(certs, target, **kwargs)
    assert code == 1
    assert line.startswith(f"{target} (server) TLS_FAILED ({cause.value}): TLS handshake "
                           f"with {target} failed: "), line
    assert says in line, line
    assert "UNREACHABLE" not in line and "UNAVAILABLE" not in line, line
    if mistake == "san_mismatch":
        assert "--server-name" in line, line


@pytest.mark.parametrize("wait", [False, True], ids=["stream", "wait"])
@pytest.mark.parametrize("mistake, says", [
    ("wrong_ca", "its certificate is not signed by the CA in --tls-ca"),
    ("san_mismatch", "does not list '127.0.0.1' in its subjectAltName (SAN mismatch)"),
])
def test_generate_names_the_tls_mistake(certs, servers, mistake, says, wait):
    """Both the call itself and --wait (which only sees the code while it polls) say it."""
    ca = certs.rogue_ca if mistake == "wrong_ca" else certs.server.ca
    target = servers["tls_elsewhere"]
    result = run("generate", "--target", target, "--tls-ca", str(ca),
                 *(["--wait", "2"] if wait else []), "hi")
    line = one_line(result, 1)
    assert line.startswith(f"error: UNAVAILABLE: TLS handshake with {target} failed: "), line
    assert says in line, line
    assert "not SERVING after" not in line, line


# --- the diagnosis itself, on what gRPC says about real handshakes --------------------------

def _details(target: str, creds: grpc.ChannelCredentials | None) -> str:
    channel = (grpc.secure_channel(target, creds) if creds is not None
               else grpc.insecure_channel(target))
    with channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                      timeout=5)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            return err.details() or ""
    raise AssertionError(f"{target} answered")


def test_a_refused_connection_or_a_good_call_is_no_tls_diagnosis(certs, servers):
    side = DialSide(tls=True, client_cert=True, ca_file="ca.pem", server_name="127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    refused = _details(closed, certs.client.channel_credentials())
    assert "Connection refused" in refused
    assert diagnose(refused, closed, side) is None
    # a call cut short after it connected is not a handshake failure
    assert diagnose("Socket closed", "x:1", side) is None


def test_plaintext_to_tls_and_tls_to_plaintext_are_named(certs, servers):
    plain = _details(servers["mtls"], None)
    got = diagnose(plain, "p:1", DialSide(tls=False, client_cert=False))
    assert got is not None and got.cause == TlsCause.CLIENT_NOT_TLS, plain
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        details = _details(f"127.0.0.1:{port}", certs.client.channel_credentials())
    finally:
        server.stop(0)
    got = diagnose(details, "p:1", DialSide(tls=True, client_cert=True))
    assert got is not None and got.cause == TlsCause.SERVER_NOT_TLS, details


# --- decode's log when it dials prefill ------------------------------------------------------

def _start_prefill(certs: Certs, identity: Identity, workdir: Path,
                   server_name: str = "") -> Service:
    """A prefill with identity's certificate that requires cluster client certificates; returns
    once a client with the cluster certificate, checking server_name (default: the address
    dialled), gets SERVING."""
    prefill = start_service("prefill", workdir, [*MODEL_FLAGS, *identity.flags()],
                            wait_healthy=False)
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []

    def serving() -> bool:
        assert prefill.proc.poll() is None, prefill.log_text()[-3000:]
        with grpc.secure_channel(prefill.address, certs.client.channel_credentials(),
                                 options) as channel:
            try:
                return health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=2).status == SERVING
            except grpc.RpcError:
                return False

    try:
        wait_until(serving, START_TIMEOUT, f"prefill in {workdir} SERVING over mTLS")
    except BaseException:
        prefill.stop()
        raise
    return prefill


def _tls_lines(log: str) -> list[dict]:
    lines = []
    for line in log.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "prefill_tls_failed":
            lines.append(record)
    return lines


@pytest.mark.slow
@pytest.mark.timeout(2 * START_TIMEOUT + 240)
def test_decode_logs_the_tls_mistake_when_it_dials_prefill(certs, tmp_path):
    """Four decodes at once, one mistake each: each logs prefill_tls_failed (an error) with
    the cause and the fix, never prefill_unreachable, and never serves."""
    secure = _start_prefill(certs, certs.server, tmp_path / "prefill")
    elsewhere = _start_prefill(certs, certs.elsewhere, tmp_path / "prefill-elsewhere",
                               server_name=OTHER_NAME)
    mistakes = {
        "wrong_ca": (secure, ["--tls-cert", str(certs.client.cert), "--tls-key",
                              str(certs.client.key), "--tls-ca", str(certs.rogue_ca)],
                     TlsCause.UNTRUSTED_SERVER, "is not signed by the CA in --tls-ca"),
        "san_mismatch": (elsewhere, certs.client.flags(), TlsCause.NAME_MISMATCH,
                         "does not list '127.0.0.1' in its subjectAltName"),
        "no_client_certificate": (secure, [], TlsCause.CLIENT_NOT_TLS,
                                  "--tls-cert/--tls-key if it requires client certificates"),
        "client_certificate_of_another_ca": (secure, certs.intruder.flags(),
                                             TlsCause.CLIENT_CERTIFICATE,
                                             "does not trust our client certificate"),
    }
    decodes: dict[str, Service] = {}
    try:
        for name, (prefill, flags, _, _) in mistakes.items():
            decodes[name] = start_service("decode", tmp_path / f"decode-{name}",
                                          [*MODEL_FLAGS, "--prefill", prefill.address, *flags],
                                          wait_healthy=False)
        for name, (prefill, _, cause, says) in mistakes.items():
            decode = decodes[name]
            log = wait_log(decode.log_path, '"prefill_tls_failed"', decode.proc,
                           timeout=START_TIMEOUT)
            record = _tls_lines(log)[0]
            assert record["level"] == "error", record
            assert record["cause"] == cause.value, (name, record)
            assert record["message"].startswith("TLS"), record
            assert f"{prefill.address}" in record["message"] and says in record["message"], (
                name, record)
            assert "prefill_unreachable" not in log, (name, log[-3000:])
            assert '"prefill_agreed"' not in log, name
    finally:
        for decode in decodes.values():
            decode.stop()
        secure.stop()
        elsewhere.stop()

