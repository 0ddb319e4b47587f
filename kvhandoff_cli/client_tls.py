"""The client commands' TLS files and connection failures, said in one line each.

gRPC reads PEM bytes without checking them, so a missing file would end in a traceback and a
file that is not PEM in gRPC core log lines followed by an unrelated UNAVAILABLE. The files are
checked here first; what gRPC says about a failed connection (a 250-character handshake error)
is turned into what to change (common.server.tls_diagnosis names the TLS causes). Imports
nothing heavy (`generate` and `health` skip torch).
"""

from __future__ import annotations

from pathlib import Path

from common.server.tls_diagnosis import DialSide, TlsDiagnosis, diagnose

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


def explain_unreachable(details: str, target: str, tls_ca: str, client_cert: bool = False,
                        server_name: str = "", name_flag: str = "") -> str | None:
    """What to change, for gRPC's details of an UNAVAILABLE connection to target; None when
    the details say nothing this knows. A TLS cause (common.server.tls_diagnosis) is said in a
    sentence that starts with "TLS"; see `tls_failure` to tell the two apart."""
    found = tls_failure(details, target, tls_ca, client_cert, server_name, name_flag)
    if found is not None:
        return found.message
    if "Connection refused" in details:
        return f"nothing listens at {target} (connection refused); start the service or fix it"
    return None


def tls_failure(details: str, target: str, tls_ca: str, client_cert: bool = False,
                server_name: str = "", name_flag: str = "") -> TlsDiagnosis | None:
    """The TLS cause of a failed connection to target, as the CLI's flags would fix it."""
    host = target.rpartition(":")[0].strip("[]") or target
    side = DialSide(tls=bool(tls_ca or client_cert), client_cert=client_cert, ca_file=tls_ca,
                    server_name=server_name or host, name_flag=name_flag)
    return diagnose(details, target, side)
