"""The prefix-cache scope decode sends prefill (SPEC.md D-80): who may share cached prompt KV.

Identity: decode is the authenticator. When it checks tokens (--api-tokens FILE, or the single
--api-token as the tenant "default"), the identity of a call is the name of the tenant whose
token the bearer-token interceptor admitted it with (common.server.auth.call_tenant), as UTF-8:
every token of one tenant is one identity, and two tenants are two, whatever their salts.
Without tokens there is no identity, and an `authorization` header a client sends is ignored
(nobody checked it). The scope is SHA-256 over a domain tag, the identity and the client's
`cache_salt`, each length-prefixed; a call with neither an identity nor a salt gets the empty
scope, which prefill never shares. A client cannot name another tenant's scope without one of
that tenant's tokens and its salt, and a scope never comes from the client as it is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import grpc

from common.errors import ServiceError
from common.server.auth import call_tenant

DOMAIN = b"kvhandoff.cache-scope.v1"


def cache_scope(identity: bytes, salt: str) -> bytes:
    """The scope of a call by `identity` (b"" when unauthenticated) with `salt`; b"" for
    neither, so that such a request shares with nobody."""
    if not identity and not salt:
        return b""
    h = hashlib.sha256(DOMAIN)
    for part in (identity, salt.encode("utf-8")):
        h.update(len(part).to_bytes(4, "big") + part)
    return h.digest()


def tenant_identity(tenant: str) -> bytes:
    """The identity of a call admitted as `tenant`: the name itself (never the token)."""
    return tenant.encode("utf-8")


def admitted_identity(context) -> bytes:
    """The identity of the running call on a server that checks tokens. A call that reached
    the servicer without a tenant (which the interceptor never lets happen) is refused rather
    than given the identity of nobody."""
    tenant = call_tenant()
    if tenant is None:
        raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED",
                           "the call was not admitted as any tenant")
    return tenant_identity(tenant)


def no_identity(context) -> bytes:
    return b""


def identity_of_calls(checks_tokens: bool) -> Callable[[object], bytes]:
    """context -> identity of the call: its tenant's when decode checks tokens, else
    nothing."""
    return admitted_identity if checks_tokens else no_identity
