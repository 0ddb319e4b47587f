"""Tenants by bearer token: the table `--api-tokens FILE` (or the single `--api-token`) defines.

File format (one tenant's token per line; a tenant may have several lines, e.g. to rotate):

    # comments start a line with '#'; blank lines are ignored
    alice  7c1f...e9
    bob    0d44...12

Each line is exactly two fields separated by whitespace, `TENANT TOKEN` (no comment after the
token: a token may contain '#'). A tenant name is 1-64 of `A-Z a-z 0-9 . _ -`, starting with a
letter or digit, and not the reserved `unauthenticated`; a token is printable ASCII without
spaces (it travels as gRPC metadata). The single `--api-token` is the table {token: "default"}.

Invariants: a table maps SHA-256(token) to a tenant name and keeps no token; a file with a bad
line, a token on two lines, or no tenant at all is refused whole with one line naming the file
and the line (TenantsFileError), and no message ever contains a token or any other field of a
line (a swapped line would put the token first). A lookup hashes the presented token and looks
the digest up, so its timing tells nothing a caller could use to guess a token. `TenantTokens`
holds the table in force: a reload that fails keeps the previous table whole.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

BEARER_PREFIX = "Bearer "
SINGLE_TOKEN_TENANT = "default"  # the tenant of --api-token
UNAUTHENTICATED = "unauthenticated"  # a metrics label for refused calls; never a tenant
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TOKEN_TEXT = re.compile(r"[\x21-\x7e]+")
NAME_RULE = ("a tenant name is 1-64 of A-Z a-z 0-9 . _ - starting with a letter or digit, "
             f"not {UNAUTHENTICATED!r}")


class TenantsFileError(ValueError):
    """A tokens file that cannot be used; the message names the file and the line, never a
    token."""


@dataclass(frozen=True)
class TokenEntry:
    line: int
    tenant: str
    token: str


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("ascii")).digest()


def _entry(path: Path, number: int, line: str) -> TokenEntry | None:
    """The entry on one line of the file (None for a blank or comment line)."""
    text = line.strip()
    if not text or text.startswith("#"):
        return None
    fields = text.split()
    where = f"tokens file {path} line {number}"
    if len(fields) != 2:
        raise TenantsFileError(f"{where}: expected 'TENANT TOKEN' (two fields), found "
                               f"{len(fields)} field{'s' if len(fields) != 1 else ''}")
    tenant, token = fields
    if not TENANT_NAME.fullmatch(tenant) or tenant == UNAUTHENTICATED:
        raise TenantsFileError(f"{where}: bad tenant name; {NAME_RULE}")
    if not TOKEN_TEXT.fullmatch(token):
        raise TenantsFileError(f"{where}: the token must be printable ASCII without spaces "
                               "(it is sent as gRPC metadata)")
    return TokenEntry(number, tenant, token)


def read_token_entries(path: Path | str) -> list[TokenEntry]:
    """Every entry of a tokens file, in file order; raises TenantsFileError on the first bad
    line, a repeated token, or a file with no entry."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise TenantsFileError(f"tokens file {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise TenantsFileError(f"tokens file {path}: not UTF-8 text") from None
    entries: list[TokenEntry] = []
    first_line: dict[bytes, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        entry = _entry(path, number, line)
        if entry is None:
            continue
        digest = _digest(entry.token)
        if digest in first_line:
            raise TenantsFileError(f"tokens file {path} line {number}: the same token is on "
                                   f"line {first_line[digest]}; a token names one tenant")
        first_line[digest] = number
        entries.append(entry)
    if not entries:
        raise TenantsFileError(f"tokens file {path}: no 'TENANT TOKEN' line; every call would "
                               "be refused")
    return entries


@dataclass(frozen=True)
class TenantTable:
    """SHA-256(token) -> tenant name."""

    by_digest: dict[bytes, str]

    @classmethod
    def single(cls, token: str) -> TenantTable:
        if not token:
            raise ValueError("the API token is empty")
        if not TOKEN_TEXT.fullmatch(token):
            raise ValueError("the API token must be printable ASCII without spaces")
        return cls({_digest(token): SINGLE_TOKEN_TENANT})

    @classmethod
    def from_file(cls, path: Path | str) -> TenantTable:
        return cls({_digest(e.token): e.tenant for e in read_token_entries(path)})

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(self.by_digest.values())

    def tenant_of(self, metadata) -> str | None:
        """The tenant of a call's metadata: exactly one `authorization` entry equal to
        `Bearer <token>` with a known token; None for anything else."""
        sent = [value for key, value in (metadata or ()) if key == "authorization"]
        if len(sent) != 1:
            return None
        value = sent[0] if isinstance(sent[0], str) else sent[0].decode("latin-1")
        if not value.startswith(BEARER_PREFIX):
            return None
        token = value[len(BEARER_PREFIX):]
        if not TOKEN_TEXT.fullmatch(token):
            return None
        return self.by_digest.get(_digest(token))


@dataclass(frozen=True)
class Reload:
    """What a reload did: ok, or why not (the old table stays); tenants added and removed."""

    ok: bool
    message: str = ""
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    tenants: int = 0
    tokens: int = 0


class TenantTokens:
    """The table in force, and where it came from (a file reloads; a single token does not).
    Lookups read one attribute, so a reload (on the event loop) swaps the table atomically."""

    def __init__(self, table: TenantTable, path: Path | None = None) -> None:
        self.table = table
        self.path = path

    @classmethod
    def from_settings(cls, api_token: str, api_tokens: str) -> TenantTokens | None:
        """The tokens of decode's settings (None when neither is set); both at once is the
        settings' error, refused before this."""
        if api_tokens:
            return cls(TenantTable.from_file(api_tokens), Path(api_tokens))
        if api_token:
            return cls(TenantTable.single(api_token))
        return None

    def tenant_of(self, metadata) -> str | None:
        return self.table.tenant_of(metadata)

    def reload(self) -> Reload:
        """Reads the file again; on any error keeps the table in force."""
        old = self.table
        if self.path is None:
            return Reload(False, "a single --api-token has no file to reload",
                          tenants=len(old.tenants), tokens=len(old.by_digest))
        try:
            new = TenantTable.from_file(self.path)
        except TenantsFileError as err:
            return Reload(False, str(err), tenants=len(old.tenants), tokens=len(old.by_digest))
        self.table = new
        return Reload(True, "", tuple(sorted(new.tenants - old.tenants)),
                      tuple(sorted(old.tenants - new.tenants)), len(new.tenants),
                      len(new.by_digest))
