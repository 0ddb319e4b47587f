"""Decode's prefix-cache scope (SPEC.md D-80): from the authenticated identity and the salt,
never the salt as sent; empty with neither."""

from __future__ import annotations

import grpc
import pytest

from common.errors import ServiceError
from decode_svc.cache_scope import cache_scope, identity_of_calls, tenant_identity


def test_neither_identity_nor_salt_is_the_empty_scope():
    assert cache_scope(b"", "") == b""


def test_scopes_differ_by_identity_and_by_salt():
    alice, bob = tenant_identity("alice"), tenant_identity("bob")
    assert alice and bob and alice != bob
    scopes = {cache_scope(i, s) for i in (b"", alice, bob) for s in ("", "x", "y")} - {b""}
    assert len(scopes) == 8  # 3 identities x 3 salts, less the empty pair
    assert cache_scope(alice, "x") == cache_scope(alice, "x")
    assert cache_scope(b"", "x") not in (b"x", b"")


def test_parts_are_length_prefixed():
    """(identity, salt) pairs that concatenate alike still differ."""
    assert cache_scope(b"ab", "c") != cache_scope(b"a", "bc")


class _Context:
    def invocation_metadata(self):
        return [("authorization", "Bearer a")]


def test_calls_have_an_identity_only_where_tokens_are_checked():
    assert identity_of_calls(False)(_Context()) == b""  # an unchecked header is ignored
    with pytest.raises(ServiceError) as err:  # tokens checked, yet no tenant admitted the call
        identity_of_calls(True)(_Context())
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
