"""Tenants by bearer token, in-process and without a model: the tokens file's format and its
refusals (one line naming the file and the line, never a token), the interceptor admitting each
call as its tenant (seen by the servicer and in every log line of the call, concurrently), an
unknown token refused UNAUTHENTICATED, reloads that swap the table or keep it whole, and metrics
labelled only by tenant names."""

from __future__ import annotations

import asyncio
import io
import json
import re

import grpc
import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from common.log import make_logger
from common.server.auth import BearerTokenInterceptor, call_tenant
from common.server.tenant_auth import TenantAuth
from common.server.tenants import (TENANT_NAME, TenantsFileError, TenantTable, TenantTokens,
                                   read_token_entries)
from decode_svc.cache_scope import cache_scope, identity_of_calls

ALICE, ALICE_2, BOB, CAROL = "tok-alice-1", "tok-alice-2", "tok-bob", "tok-carol"
TOKENS_FILE = f"""# tenant  token
alice   {ALICE}

bob     {BOB}
  # alice rotates: both of her tokens work
alice   {ALICE_2}
"""
WHO = "/test.Who/"


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture
def tokens_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(TOKENS_FILE)
    path.chmod(0o600)
    return path


def test_the_file_maps_each_token_to_its_tenant(tokens_file):
    table = TenantTable.from_file(tokens_file)
    assert table.tenants == {"alice", "bob"} and len(table.by_digest) == 3
    assert [e.line for e in read_token_entries(tokens_file)] == [2, 4, 6]
    for token, tenant in ((ALICE, "alice"), (ALICE_2, "alice"), (BOB, "bob")):
        assert table.tenant_of(_bearer(token)) == tenant
        assert table.tenant_of([("authorization", f"Bearer {token}".encode())]) == tenant
    assert not any(token.encode() in key for key in table.by_digest for token in (ALICE, BOB))


@pytest.mark.parametrize("metadata", [
    (), _bearer("tok-nobody"), _bearer(""), (("authorization", f"bearer {BOB}"),),
    (("authorization", BOB),), (("authorization", f"Bearer  {BOB}"),),
    (*_bearer(BOB), *_bearer(BOB)), (("x-authorization", f"Bearer {BOB}"),)])
def test_anything_but_one_bearer_entry_with_a_known_token_is_no_tenant(tokens_file, metadata):
    assert TenantTable.from_file(tokens_file).tenant_of(metadata) is None


SECRET = "s3cr3t-never-printed"
BAD_FILES = {
    "one field": (f"alice {ALICE}\n{SECRET}\n", 2, "two fields"),
    "three fields": (f"alice {SECRET} extra\n", 1, "found 3 fields"),
    "swapped": (f"{SECRET}/x alice\n", 1, "bad tenant name"),
    "reserved name": (f"unauthenticated {SECRET}\n", 1, "bad tenant name"),
    "long name": ("a" * 65 + f" {SECRET}\n", 1, "bad tenant name"),
    "non-ascii token": (f"alice {SECRET}\u00e9\n", 1, "printable ASCII"),
    "duplicate token": (f"alice {SECRET}\n# x\nbob {SECRET}\n", 3, "on line 1"),
    "no tenant": ("# nothing here\n\n", None, "no 'TENANT TOKEN' line"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_file_is_refused_in_one_line_naming_the_line_never_the_token(tmp_path, case):
    text, line, words = BAD_FILES[case]
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(TenantsFileError) as err:
        TenantTable.from_file(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and words in message, message
    assert (f"line {line}:" in message) if line else not re.search(r"line \d", message)
    assert SECRET not in message and ALICE not in message and "alice" not in message


def test_a_file_that_is_not_text_or_not_there_is_refused(tmp_path):
    (tmp_path / "binary").write_bytes(b"alice \xff\xfe\n")
    for name, words in (("binary", "not UTF-8"), ("absent", "No such file")):
        with pytest.raises(TenantsFileError, match=words):
            TenantTable.from_file(tmp_path / name)


def test_the_single_token_is_the_tenant_default():
    table = TenantTable.single(BOB)
    assert table.tenant_of(_bearer(BOB)) == "default" and table.tenant_of(_bearer(ALICE)) is None
    for bad in ("", "two words"):
        with pytest.raises(ValueError):
            TenantTable.single(bad)


def test_reload_swaps_the_table_and_a_bad_file_keeps_it_whole(tokens_file):
    tokens = TenantTokens(TenantTable.from_file(tokens_file), tokens_file)
    tokens_file.write_text(f"alice {ALICE}\ncarol {CAROL}\n")
    result = tokens.reload()
    assert result.ok and result.added == ("carol",) and result.removed == ("bob",)
    assert tokens.tenant_of(_bearer(CAROL)) == "carol" and tokens.tenant_of(_bearer(BOB)) is None
    assert tokens.tenant_of(_bearer(ALICE_2)) is None  # her old token went with the old table
    before = tokens.table
    tokens_file.write_text(f"alice {ALICE}\nbob {ALICE}\n")
    result = tokens.reload()
    assert not result.ok and "line 2" in result.message and ALICE not in result.message
    assert tokens.table is before and tokens.tenant_of(_bearer(CAROL)) == "carol"


def _who_handlers(log) -> grpc.GenericRpcHandler:
    identity = identity_of_calls(True)

    async def unary(request, context):
        await asyncio.sleep(0.05)  # overlaps the other tenant's call
        log.info("served", kind="unary")
        return call_tenant().encode() + b"|" + cache_scope(identity(context), "").hex().encode()

    async def stream(request, context):
        for _ in range(3):
            await asyncio.sleep(0.02)
            log.info("served", kind="stream")
            yield call_tenant().encode()

    return grpc.method_handlers_generic_handler("test.Who", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(stream)})


async def test_each_call_runs_as_its_tenant_in_the_servicer_and_its_logs(tokens_file):
    out = io.StringIO()
    log = make_logger("decode", out)
    tokens = TenantTokens(TenantTable.from_file(tokens_file), tokens_file)
    registry = CollectorRegistry()
    auth = TenantAuth(tokens, registry, "decode", "m", log)
    server = grpc.aio.server(interceptors=[auth.interceptor])
    server.add_generic_rpc_handlers([_who_handlers(log)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            unary, stream = channel.unary_unary(WHO + "Unary"), channel.unary_stream(WHO + "Stream")

            async def streamed(token: str) -> list[bytes]:
                return [r async for r in stream(b"", metadata=_bearer(token), timeout=5)]

            replies = await asyncio.gather(*(unary(b"", metadata=_bearer(t), timeout=5)
                                             for t in (ALICE, BOB, ALICE_2, BOB)))
            streams = await asyncio.gather(streamed(ALICE), streamed(BOB))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await unary(b"", metadata=_bearer(CAROL), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert call_tenant() is None  # nothing leaked into the client's task
    finally:
        await server.stop(0)
    tenants = [r.split(b"|")[0] for r in replies]
    scopes = [r.split(b"|")[1] for r in replies]
    assert tenants == [b"alice", b"bob", b"alice", b"bob"]
    assert scopes[0] == scopes[2] != scopes[1] == scopes[3]  # no salt: one scope per tenant
    assert streams == [[b"alice"] * 3, [b"bob"] * 3]
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    served = [line for line in lines if line["event"] == "served"]
    assert len(served) == 10 and {line["tenant"] for line in served} == {"alice", "bob"}
    assert sum(line["tenant"] == "alice" and line["kind"] == "stream" for line in served) == 3
    refused = [line for line in lines if line["event"] == "call_unauthenticated"]
    assert len(refused) == 1 and refused[0]["why"] == "unknown token"
    assert "tenant" not in refused[0]
    for token in (ALICE, ALICE_2, BOB, CAROL):
        assert token not in out.getvalue()
    metrics = generate_latest(registry).decode()
    calls = [line for line in metrics.splitlines() if line.startswith("kvhandoff_api_calls_total")]
    assert {line.split('tenant="')[1].split('"')[0] for line in calls} == {
        "alice", "bob", "unauthenticated"}
    assert 'tenant="alice"} 3.0' in metrics and 'tenant="unauthenticated"} 1.0' in metrics
    assert 'kvhandoff_api_tenants{model_name="m",role="decode"} 2.0' in metrics
    structlog.contextvars.clear_contextvars()


def test_tenant_auth_counts_reloads_and_logs_why_one_failed(tokens_file):
    out = io.StringIO()
    registry = CollectorRegistry()
    auth = TenantAuth(TenantTokens(TenantTable.from_file(tokens_file), tokens_file), registry,
                      "decode", "m", make_logger("decode", out))
    tokens_file.write_text(f"carol {CAROL}\n")
    assert auth.reload().ok
    tokens_file.write_text(f"carol {CAROL}\ncarol\n")
    assert not auth.reload().ok and auth.tokens.tenant_of(_bearer(CAROL)) == "carol"
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["event"] for line in lines] == [
        "api_tenants_loaded", "api_tokens_reloaded", "api_tokens_reload_failed"]
    assert lines[0]["tenants"] == ["alice", "bob"] and lines[1]["removed"] == ["alice", "bob"]
    assert "line 2" in lines[2]["message"] and "keeping the previous table" in lines[2]["message"]
    metrics = generate_latest(registry).decode()
    assert 'result="ok",role="decode"} 1.0' in metrics
    assert 'result="failed",role="decode"} 1.0' in metrics
    assert CAROL not in out.getvalue()


def test_the_interceptor_still_takes_one_token():
    interceptor = BearerTokenInterceptor(BOB)
    assert interceptor.authorized(_bearer(BOB)) and not interceptor.authorized(_bearer(ALICE))


NAMES = st.one_of(st.from_regex(r"[a-zA-Z0-9][a-zA-Z0-9._-]{0,6}", fullmatch=True),
                  st.text(alphabet="abAB09._-/ #é", min_size=0, max_size=6))
TOKEN_TEXTS = st.one_of(st.sampled_from(["xy", "x#y", "x=/+", "zz"]),  # repeats: duplicates
                        st.text(alphabet="xyzXYZ019#/=+-é ", min_size=0, max_size=12)).map(
    lambda s: "tk" + s + "q")  # "tk...q": never a piece of the path or of a message's words


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(NAMES, TOKEN_TEXTS), min_size=0, max_size=5))
def test_any_file_loads_exactly_or_is_refused_without_a_token(tmp_path, pairs):
    path = tmp_path / "tokens"
    path.write_text("".join(f"{name} {token}\n" for name, token in pairs))
    lines = [f"{name} {token}".split() for name, token in pairs]
    entries = [fields for fields in lines if not fields[0].startswith("#")]  # not comments
    valid = (bool(entries) and len({fields[-1] for fields in entries}) == len(entries)
             and all(len(fields) == 2 and TENANT_NAME.fullmatch(fields[0])
                     and fields[0] != "unauthenticated" and fields[1].isascii()
                     for fields in entries))
    try:
        table = TenantTable.from_file(path)
    except TenantsFileError as err:
        assert not valid, str(err)
        assert "\n" not in str(err) and not any(token in str(err) for _, token in pairs)
        return
    assert valid
    assert all(table.tenant_of(_bearer(token)) == name for name, token in entries)
    assert len(table.by_digest) == len(entries)
