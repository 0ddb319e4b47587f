"""Why a gRPC connection failed, when the reason is TLS: the cause named, and what to change.

gRPC's Python API gives no handshake error of its own: the reason is only in the details string
of the UNAVAILABLE that a call without wait_for_ready gets ("failed to connect to all
addresses; last error: UNKNOWN: ipv4:127.0.0.1:50061: Tls handshake failed (TSI_PROTOCOL_FAILURE):
... CERTIFICATE_VERIFY_FAILED ..."). `diagnose` reads those details for the causes a person can
fix and says each in one sentence that starts with "TLS"; the CLI prints it and decode logs it
when it dials prefill. A call with wait_for_ready ends in a bare DEADLINE_EXCEEDED instead:
callers ask once more without waiting to get the details.

Invariants: a diagnosis is returned only for details that show a TLS handshake failed or that
the peer closed the connection while one side spoke TLS; a refused connection, a DNS failure or
anything unknown gives None (the caller keeps its own "unreachable" wording). Imports nothing
heavy (the `health` command must stay cheap).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TlsCause(enum.Enum):
    """The likely cause; the value is the stable name logged as `cause`."""

    UNTRUSTED_SERVER = "server_certificate_not_trusted"  # our CA did not sign the server's
    NAME_MISMATCH = "server_name_not_in_certificate"  # its SANs do not list the name dialled
    CLIENT_CERTIFICATE = "client_certificate_refused"  # the server wants one we did not give,
    # or one signed by a CA it trusts: it closes the connection during the handshake
    SERVER_NOT_TLS = "server_not_tls"  # we spoke TLS to a plaintext server
    CLIENT_NOT_TLS = "client_not_tls"  # we spoke plaintext to a server that closed on us
    HANDSHAKE_FAILED = "handshake_failed"  # a handshake error none of the above explains


@dataclass(frozen=True)
class DialSide:
    """What the dialling side had: TLS or not, a client certificate or not, the CA file it
    trusts, the name the server's certificate must carry, and its flag names (they differ
    between the CLI and decode's own --tls-* only in the name override)."""

    tls: bool
    client_cert: bool
    ca_file: str = ""
    server_name: str = ""  # the host dialled, or the override checked instead
    name_flag: str = ""  # the flag that overrides the checked name ('' when there is none)


@dataclass(frozen=True)
class TlsDiagnosis:
    cause: TlsCause
    message: str  # one sentence, starting "TLS", naming the peer and the fix


HANDSHAKE_FAILED = ("Tls handshake failed", "Ssl handshake failed", "SSL_ERROR_SSL",
                    "TSI_PROTOCOL_FAILURE", "handshake failed")
UNTRUSTED = ("CERTIFICATE_VERIFY_FAILED", "unable to get local issuer certificate",
             "self signed certificate", "self-signed certificate", "certificate verify failed")
NAME_MISMATCH = ("Hostname Verification Check failed", "not in peer certificate",
                 "Peer name", "hostname mismatch")
NOT_TLS = ("WRONG_VERSION_NUMBER", "wrong version number", "PACKET_LENGTH_TOO_LONG",
           "record layer failure")
CLOSED = ("Socket closed", "Connection reset by peer", "End of TCP stream", "Broken pipe")
CONNECTING = ("failed to connect",)  # a close while connecting, not a call cut short later


def _has(details: str, needles: tuple[str, ...]) -> bool:
    return any(n.lower() in details.lower() for n in needles)


def diagnose(details: str, peer: str, side: DialSide) -> TlsDiagnosis | None:
    """The TLS cause that gRPC's details of a failed connection to peer show, or None."""
    if _has(details, NAME_MISMATCH):
        name = side.server_name or peer
        fix = (f"; or dial it by a name its certificate lists (or set {side.name_flag} NAME)"
               if side.name_flag else "; or dial it by a name its certificate lists")
        return TlsDiagnosis(TlsCause.NAME_MISMATCH,
                            f"TLS handshake with {peer} failed: its certificate does not list "
                            f"{name!r} in its subjectAltName (SAN mismatch); reissue it with "
                            f"the name clients dial (DNS:{name} or IP:ADDRESS){fix}")
    if _has(details, UNTRUSTED):
        ca = f"--tls-ca {side.ca_file}" if side.ca_file else "the system's CA bundle"
        return TlsDiagnosis(TlsCause.UNTRUSTED_SERVER,
                            f"TLS handshake with {peer} failed: its certificate is not signed "
                            f"by the CA in {ca}; give the CA that signed the server's "
                            f"certificate")
    if _has(details, NOT_TLS):
        return TlsDiagnosis(TlsCause.SERVER_NOT_TLS,
                            f"TLS handshake with {peer} failed: it does not speak TLS (it "
                            f"answered in plaintext); drop the --tls-* flags here, or give "
                            f"the server its --tls-cert/--tls-key")
    if _has(details, CLOSED) and _has(details, CONNECTING):
        if not side.tls:
            return TlsDiagnosis(TlsCause.CLIENT_NOT_TLS,
                                f"TLS likely required: {peer} closed a plaintext connection "
                                f"before answering; if it serves TLS, pass --tls-ca with the CA "
                                f"that signed its certificate (and --tls-cert/--tls-key if it "
                                f"requires client certificates)")
        if not side.client_cert:
            return TlsDiagnosis(TlsCause.CLIENT_CERTIFICATE,
                                f"TLS handshake with {peer} failed: it closed the connection, "
                                f"most likely because it requires a client certificate (mTLS) "
                                f"and none was given; pass --tls-cert/--tls-key signed by a CA "
                                f"it trusts")
        return TlsDiagnosis(TlsCause.CLIENT_CERTIFICATE,
                            f"TLS handshake with {peer} failed: it closed the connection, most "
                            f"likely because it does not trust our client certificate (--tls-cert "
                            f"is not signed by the CA in its --tls-ca); issue it from that CA")
    if _has(details, HANDSHAKE_FAILED):
        return TlsDiagnosis(TlsCause.HANDSHAKE_FAILED,
                            f"TLS handshake with {peer} failed ({_last_error(details)}); check "
                            f"that --tls-ca signed its certificate and the name dialled is in "
                            f"its subjectAltName")
    return None


def _last_error(details: str) -> str:
    """The part of gRPC's details after 'last error:', which says what the handshake hit."""
    return details.rpartition("last error:")[2].strip() or details
