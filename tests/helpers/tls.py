"""Throwaway certificate authorities and certificates for tests, made with the openssl CLI
(the `cryptography` package is not installed in this venv). Every leaf certificate is valid for
127.0.0.1 and localhost and for both server and client authentication, for one day."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import grpc

SAN = "subjectAltName=IP:127.0.0.1,DNS:localhost"
LEAF_REST = ("basicConstraints=critical,CA:FALSE\n"
             "keyUsage=critical,digitalSignature,keyEncipherment\n"
             "extendedKeyUsage=serverAuth,clientAuth\n")
LEAF_EXTENSIONS = f"{SAN}\n{LEAF_REST}"
EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True,
                            check=False)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {result.stderr}")


@dataclass(frozen=True)
class Identity:
    """A leaf certificate, its key, and the CA certificate that signed it (PEM paths)."""

    cert: Path
    key: Path
    ca: Path

    def flags(self, prefix: str = "--tls") -> list[str]:
        """--tls-cert/--tls-key/--tls-ca flags of a service for this identity."""
        return [f"{prefix}-cert", str(self.cert), f"{prefix}-key", str(self.key),
                f"{prefix}-ca", str(self.ca)]

    def channel_credentials(self, trust: Path | None = None,
                            present_cert: bool = True) -> grpc.ChannelCredentials:
        """Trusts `trust` (default: the signing CA); presents this certificate if asked."""
        return grpc.ssl_channel_credentials(
            root_certificates=(trust or self.ca).read_bytes(),
            private_key=self.key.read_bytes() if present_cert else None,
            certificate_chain=self.cert.read_bytes() if present_cert else None)


@dataclass(frozen=True)
class CertificateAuthority:
    cert: Path
    key: Path

    @classmethod
    def create(cls, root: Path, name: str) -> CertificateAuthority:
        root.mkdir(parents=True, exist_ok=True)
        _openssl("req", "-x509", *EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.pem",
                 "-days", "1", "-subj", f"/CN={name}",
                 "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=root)
        return cls(root / f"{name}.pem", root / f"{name}.key")

    def issue(self, name: str, san: str = "") -> Identity:
        """A leaf certificate named name, in the CA's folder; san (e.g. 'DNS:prefill.example')
        replaces the default subjectAltName of 127.0.0.1 and localhost."""
        root = self.cert.parent
        (root / f"{name}.ext").write_text(f"subjectAltName={san}\n{LEAF_REST}" if san
                                          else LEAF_EXTENSIONS)
        _openssl("req", *EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=root)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", self.cert.name, "-CAkey",
                 self.key.name, "-CAcreateserial", "-out", f"{name}.pem", "-days", "1",
                 "-extfile", f"{name}.ext", cwd=root)
        return Identity(root / f"{name}.pem", root / f"{name}.key", self.cert)
