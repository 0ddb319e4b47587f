"""The prefix-cache scope decode sends prefill (SPEC.md D-80): who may share cached prompt KV.

Identity: decode is the authenticator. With --api-token, the identity of a call is the SHA-256
of the bearer token that authenticated it (the interceptor has already refused every other
token), so everyone holding one token is one tenant; without --api-token there is no identity,
and an `authorization` header a client sends is ignored (nobody checked it). The scope is
SHA-256 over a domain tag, the identity and the client's `cache_salt`, each length-prefixed; a
call with neither an identity nor a salt gets the empty scope, which prefill never shares. A
client cannot name another tenant's scope without that tenant's token and salt, and a scope
never comes from the client as it is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

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


def bearer_identity(metadata) -> bytes:
    """The identity of a call the bearer-token interceptor let through: SHA-256 of its token.
    Only for servers that check tokens (`identity_of_calls`)."""
    sent = [value for key, value in (metadata or ()) if key == "authorization"]
    if len(sent) != 1:
        return b""
    value = sent[0] if isinstance(sent[0], bytes) else sent[0].encode()
    return hashlib.sha256(value).digest()


def no_identity(context) -> bytes:
    return b""


def identity_of_calls(checks_tokens: bool) -> Callable[[object], bytes]:
    """context -> identity of the call: the bearer token's hash when decode checks tokens,
    else nothing."""
    if not checks_tokens:
        return no_identity
    return lambda context: bearer_identity(context.invocation_metadata())
