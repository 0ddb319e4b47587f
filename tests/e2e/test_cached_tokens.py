"""Cached prompt tokens in usage (protocol 1.2, SPEC.md P-90, D-90) through real services: a
prompt seen again in the same cache scope (tenant and salt) reports the whole pages prefill
served from its prefix cache, the same number over HTTP (the `openai` client, whole and in the
streamed usage chunk) and over gRPC (Usage.cached_prompt_tokens); another salt, another tenant,
and a prefill started with --no-prefix-cache report 0. Counts are compared with the pages of
the prompt, never timed."""

from __future__ import annotations

import os

import grpc
import openai
import pytest

from common.pb.kvhandoff.v1 import (common_pb2, generate_pb2, generate_pb2_grpc, handoff_pb2,
                                    handoff_pb2_grpc)
from conformance.binding import commit_crc
from tests.helpers.checkpoints import make_chat_checkpoint
from tests.helpers.cluster import start_cluster
from tests.ops.helpers import log_events

pytestmark = pytest.mark.slow

PAGE = 16
TOKEN_A, TOKEN_B = "cached-tok-a", "cached-tok-b"
TOKENS = f"team-a {TOKEN_A}\nteam-b {TOKEN_B}\n"
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away. " * 2
COMMON = ["--dtype", "float32", "--page-size", str(PAGE), "--pool-tokens", "4096"]


def _start(root, prefill_flags: list[str]):
    path, _, hf_tok = make_chat_checkpoint(root)
    tokens = root / "tokens"
    tokens.write_text(TOKENS)
    tokens.chmod(0o600)
    cluster = start_cluster(root / "run", str(path), prefill_flags=prefill_flags, decode_flags=[
        "--http-port", "0", "--api-tokens", str(tokens)], common_flags=COMMON)
    port = next(int(e["http_port"]) for e in log_events(cluster.decode)
                if e.get("event") == "listening")
    return cluster, f"http://127.0.0.1:{port}", str(path), hf_tok


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cluster, *rest = _start(tmp_path_factory.mktemp("cached"), [])
    yield (cluster, *rest)
    cluster.stop()


@pytest.fixture(scope="module")
def uncached(tmp_path_factory):
    cluster, *rest = _start(tmp_path_factory.mktemp("uncached"), ["--no-prefix-cache"])
    yield (cluster, *rest)
    cluster.stop()


def _http(base: str, model: str, token: str, salt: str, stream: bool = False
          ) -> tuple[int, int]:
    """-> (prompt tokens, cached tokens) of one completion over HTTP."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=token, max_retries=0, timeout=120)
    args = {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
            "extra_body": {"ignore_eos": True, "cache_salt": salt}}
    if stream:
        chunks = list(client.completions.create(**args, stream=True,
                                                stream_options={"include_usage": True}))
        usage = chunks[-1].usage
    else:
        usage = client.completions.create(**args).usage
    return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def _grpc(address: str, token: str, salt: str) -> tuple[int, int]:
    request = generate_pb2.GenerateRequest(text=PROMPT, max_tokens=2, ignore_eos=True,
                                           cache_salt=salt)
    with grpc.insecure_channel(address) as channel:
        for response in generate_pb2_grpc.GenerationServiceStub(channel).Generate(
                request, timeout=120, metadata=[("authorization", f"Bearer {token}")]):
            if response.HasField("finished"):
                usage = response.finished.usage
                return usage.prompt_tokens, usage.cached_prompt_tokens
    raise AssertionError("no finished message")


def _whole_pages_before_last(n: int) -> int:
    """What a hit can lend (P-81): the prompt's whole pages, never its last token."""
    return (n - 1) // PAGE * PAGE


def test_a_repeated_prompt_reports_its_cached_pages_on_both_front_doors(served):
    cluster, base, model, _ = served
    n, first = _http(base, model, TOKEN_A, "salt-1")
    assert n > PAGE and first == 0  # computed in full, and now cached in (team-a, salt-1)
    expected = _whole_pages_before_last(n)
    assert 0 < expected < n
    assert _http(base, model, TOKEN_A, "salt-1") == (n, expected)
    assert _http(base, model, TOKEN_A, "salt-1", stream=True) == (n, expected)
    assert _grpc(cluster.address, TOKEN_A, "salt-1") == (n, expected)


def test_another_salt_or_tenant_reports_nothing_cached(served):
    cluster, base, model, _ = served
    n, _ = _http(base, model, TOKEN_A, "salt-2")  # (team-a, salt-2) now cached
    assert _http(base, model, TOKEN_A, "salt-2")[1] == _whole_pages_before_last(n)
    assert _http(base, model, TOKEN_A, "salt-3") == (n, 0)  # another salt
    assert _grpc(cluster.address, TOKEN_B, "salt-2") == (n, 0)  # another tenant, same salt


def test_without_a_prefix_cache_nothing_is_reported_cached(uncached):
    cluster, base, model, _ = uncached
    n, _ = _http(base, model, TOKEN_A, "salt-1")
    assert _http(base, model, TOKEN_A, "salt-1") == (n, 0)
    assert _grpc(cluster.address, TOKEN_A, "salt-1") == (n, 0)


def _prefill_commit(address: str, minor: int, scope: bytes, tokens: list[int]):
    """The commit prefill sends for a handoff asked in protocol 1.<minor>."""
    with grpc.insecure_channel(address) as channel:
        stub = handoff_pb2_grpc.HandoffServiceStub(channel)
        info = stub.GetPrefillInfo(handoff_pb2.GetPrefillInfoRequest(), timeout=60)
        request = handoff_pb2.PrefillRequest(
            request_id=f"raw-{minor}-{os.urandom(4).hex()}", token_ids=tokens,
            protocol_version=common_pb2.ProtocolVersion(major=1, minor=minor),
            model_fingerprint=info.model_fingerprint, max_chunk_bytes=1 << 20,
            nonce=os.urandom(16), cache_scope=scope)
        frames = list(stub.Prefill(request, timeout=120))
    commit = frames[-1].commit
    assert frames[-1].HasField("commit") and commit.status == handoff_pb2.HANDOFF_STATUS_OK
    return commit


def test_prefill_reports_cached_tokens_only_to_a_1_2_request(served):
    """P-90: a 1.1 request's commit never carries the field, so its checksum is 1.1's own."""
    cluster, *_ = served
    tokens, scope = list(range(5, 5 + 3 * PAGE + 5)), os.urandom(32)
    assert _prefill_commit(cluster.prefill.address, 2, scope, tokens).cached_tokens == 0
    again = _prefill_commit(cluster.prefill.address, 2, scope, tokens)
    assert again.cached_tokens == 3 * PAGE and again.commit_crc32c == commit_crc(again)
    old = _prefill_commit(cluster.prefill.address, 1, scope, tokens)  # cached, but 1.1
    assert old.cached_tokens == 0  # proto3: field 9 absent from the wire
    assert old.commit_crc32c == commit_crc(old)  # with no count: the 1.1 checksum
