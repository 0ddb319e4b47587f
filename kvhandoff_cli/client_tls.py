"""The client commands' TLS files and connection failures, said in one line each.

gRPC reads PEM bytes without checking them, so a missing file would end in a traceback and a
file that is not PEM in gRPC core log lines followed by an unrelated UNAVAILABLE. The files are
checked here first; what gRPC says about a failed connection (a 250-character handshake error)
is turned into what to change. Imports nothing heavy (`generate` and `health` skip torch).
"""

from __future__ import annotations

from pathlib import Path

WHAT = {"--tls-ca": ("certificate", "the CA certificate that signed the server's certificate"),
        "--tls-cert": ("certificate", "your client certificate"),
        "--tls-key": ("private key", "the private key of --tls-cert")}
MARKERS = {"certificate": b"-----BEGIN CERTIFICATE-----", "private key": b"PRIVATE KEY-----"}


class TlsFileError(ValueError):
    """A TLS file the command cannot use; the message names the flag, the file and the fix."""


def read_pem(path: str, flag: str) -> bytes:
    """The bytes of the PEM file given to flag (--tls-ca, --tls-cert or --tls-key)."""
    kind, fix = WHAT[flag]
    file = Path(path)
    if not file.exists():
        raise TlsFileError(f"{flag} {path}: no such file; give the PEM file of {fix}")
    if not file.is_file():
        raise TlsFileError(f"{flag} {path}: not a file; give the PEM file of {fix}")
    try:
        data = file.read_bytes()
    except OSError as err:
        raise TlsFileError(f"{flag} {path}: cannot read it ({err.strerror})") from None
    if MARKERS[kind] not in data:
        raise TlsFileError(f"{flag} {path}: not a PEM {kind} (no '{MARKERS[kind].decode()}' "
                           f"line); give the PEM file of {fix}")
    return data


def explain_unreachable(details: str, target: str, tls_ca: str) -> str | None:
    """What to change, for gRPC's details of an UNAVAILABLE connection to target; None when
    the details say nothing this knows."""
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return (f"TLS handshake with {target} failed: its certificate is not signed by the CA "
                f"in --tls-ca {tls_ca}; give the CA that signed the server's certificate")
    if "WRONG_VERSION_NUMBER" in details:
        return f"{target} does not speak TLS; drop --tls-ca (or give the server a certificate)"
    if "not in peer certificate" in details or "Peer name" in details:
        return (f"{target}'s certificate does not name that host; connect by a name it lists "
                f"(or pass --server-name NAME to health)")
    if "Connection refused" in details:
        return f"nothing listens at {target} (connection refused); start the service or fix it"
    if "Socket closed" in details and not tls_ca:
        return (f"{target} closed the connection; if it serves TLS, pass --tls-ca with the CA "
                f"that signed its certificate")
    return None
