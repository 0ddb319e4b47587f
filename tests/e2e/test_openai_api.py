"""The OpenAI-compatible HTTP API on decode, driven by the official `openai` client (and raw
HTTP where the client would hide the bytes): models, completions and chat whole and streamed,
usage, stop strings, error objects, bearer auth, disconnects that free pages, 8 concurrent
streams, and the same text over HTTP as over gRPC at temperature 0. One cluster (a tiny
Llama-3.1-style checkpoint with a tokenizer and a chat template, --api-token set) serves the
module."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import urllib.error
import urllib.request
from dataclasses import dataclass

import grpc
import openai
import pytest

from common.pb.kvhandoff.v1 import generate_pb2, generate_pb2_grpc, stats_pb2, stats_pb2_grpc
from tests.helpers.checkpoints import make_chat_checkpoint
from tests.helpers.cluster import start_cluster
from tests.helpers.polling import wait_until
from tests.ops.helpers import log_events

pytestmark = pytest.mark.slow

TOKEN = "openai-api-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GRPC_AUTH = [("authorization", f"Bearer {TOKEN}")]
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai")
    path, _, hf_tok = make_chat_checkpoint(root)
    cluster = start_cluster(root / "run", str(path), decode_flags=[
        "--http-port", "0", "--api-token", TOKEN], common_flags=[
        "--dtype", "float32", "--page-size", "16", "--pool-tokens", "4096"])
    port = next(int(e["http_port"]) for e in log_events(cluster.decode)
                if e.get("event") == "listening")
    yield cluster, f"http://127.0.0.1:{port}", str(path), hf_tok
    cluster.stop()


def _client(base: str, key: str = TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)


def _grpc(address: str, request: generate_pb2.GenerateRequest) -> tuple[str, generate_pb2.Usage]:
    pieces = []
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        for response in stub.Generate(request, timeout=120,
                                      metadata=GRPC_AUTH):
            if response.HasField("token"):
                pieces.append(response.token.text)
            else:
                return "".join(pieces) + response.finished.text, response.finished.usage
    raise AssertionError("no finished message")


@dataclass(frozen=True)
class Raw:
    status: int
    text: str

    def json(self):
        return json.loads(self.text)


def _raw(method: str, url: str, body: object = None, headers: dict | None = None,
         data: bytes | None = None, timeout: float = 60) -> Raw:
    """One plain HTTP call (the bytes the client would hide); never raises on a status."""
    if body is not None:
        data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={
        "Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return Raw(reply.status, reply.read().decode())
    except urllib.error.HTTPError as err:
        return Raw(err.code, err.read().decode())


def _pools(cluster) -> list:
    pools = []
    for service, metadata in ((cluster.prefill, ()), (cluster.decode, GRPC_AUTH)):
        with grpc.insecure_channel(service.address) as channel:
            pools.append(stats_pb2_grpc.StatsServiceStub(channel).GetStats(
                stats_pb2.GetStatsRequest(), timeout=10, metadata=metadata).pool)
    return pools


def assert_pools_at_baseline(cluster) -> None:
    """Both pools fully free (decode's stats need the token too)."""
    wait_until(lambda: all(p.pages_free == p.pages_total for p in _pools(cluster)), 10,
               lambda: f"pools back at baseline: {_pools(cluster)}")


def test_models_lists_the_served_checkpoint(served):
    _, base, model, _ = served
    models = _client(base).models.list().data
    assert [m.id for m in models] == [model]


def test_completion_whole_and_streamed_equal_grpc_text(served):
    cluster, base, model, _ = served
    text, grpc_usage = _grpc(cluster.address, generate_pb2.GenerateRequest(
        text=PROMPT, max_tokens=12, ignore_eos=True))
    client = _client(base)
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == text and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == grpc_usage.prompt_tokens
    assert whole.usage.completion_tokens == 12 == grpc_usage.completion_tokens
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_whole_and_streamed_equal_grpc_text(served):
    cluster, base, model, hf_tok = served
    request = generate_pb2.GenerateRequest(max_tokens=10, ignore_eos=True)
    request.messages.messages.extend(generate_pb2.ChatMessage(**m) for m in MESSAGES)
    text, grpc_usage = _grpc(cluster.address, request)
    prompt = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                        tokenize=True)["input_ids"]
    client = _client(base)
    whole = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                           max_completion_tokens=10,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == text
    assert whole.usage.prompt_tokens == len(prompt) == grpc_usage.prompt_tokens
    stream = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                            max_tokens=10, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage  # include_usage: one last chunk with no choices
    assert chunks[-1].choices == [] and usage.completion_tokens == 10
    assert usage.total_tokens == len(prompt) + 10
    # the same prompt again in the same tenant (--api-token): every whole page before the last
    # token came from prefill's cache
    assert usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // 16 * 16 > 0


def test_stop_string_ends_the_text_right_before_it(served):
    cluster, base, model, _ = served
    client = _client(base)
    args = {"model": model, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**args).choices[0].text
    start = next(i for i in range(len(full) // 3, len(full) - 2)
                 if "\ufffd" not in full[i:i + 2] and full[i:i + 2].strip())
    stop = full[start:start + 2]
    cut = full.find(stop)
    whole = client.completions.create(**args, stop=[stop, "never \u2603"])
    assert whole.choices[0].text == full[:cut] and whole.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(**args, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == full[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert_pools_at_baseline(cluster)


@pytest.mark.parametrize("path, body, status, code, param", [
    ("completions", {"prompt": "x", "n": 2}, 400, "UNSUPPORTED_PARAMETER", "n"),
    ("completions", {"prompt": "x", "logprobs": 2}, 400, "UNSUPPORTED_PARAMETER", "logprobs"),
    ("chat/completions", {"messages": MESSAGES, "logprobs": True}, 400,
     "UNSUPPORTED_PARAMETER", "logprobs"),
    ("chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {}}}]}, 400, "UNSUPPORTED_PARAMETER", "tools"),
    ("completions", {"prompt": ["a", "b"]}, 400, "UNSUPPORTED_PARAMETER", "prompt"),
    ("completions", {"prompt": "x", "max_tokens": 100000}, 400, "MAX_TOKENS_TOO_LARGE", None),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "INVALID_PARAMETER", "max_tokens"),
    ("completions", {"prompt": "x", "temperature": -1}, 400, "BAD_SAMPLING", None),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, "INVALID_PARAMETER",
     "temperature"),
    ("completions", {"prompt": ""}, 400, "EMPTY_PROMPT", None),
    ("completions", {"prompt": [999999]}, 400, "TOKEN_OUT_OF_VOCAB", None),
    ("completions", {"prompt": "x" * 3000}, 400, "PROMPT_TOO_LONG", None),
    ("completions", {"prompt": "x", "stop": ["s"] * 17}, 400, "BAD_STOP_STRINGS", None),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "INVALID_PARAMETER", "stream_options"),
    ("completions", {"model": "other", "prompt": "x"}, 404, "MODEL_NOT_FOUND", "model"),
    ("chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400,
     "CHAT_TEMPLATE_ERROR", None),
    ("chat/completions", {"messages": []}, 400, "INVALID_PARAMETER", "messages"),
    ("nowhere", {}, 404, "NOT_FOUND", None),
])
def test_user_errors_are_4xx_openai_error_objects(served, path, body, status, code, param):
    cluster, base, _, _ = served
    reply = _raw("POST", f"{base}/v1/{path}", body, AUTH)
    assert reply.status == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["param"] == param
    assert error["message"] and "Traceback" not in reply.text


def test_bad_json_is_a_400_and_the_client_raises_bad_request(served):
    _, base, model, _ = served
    reply = _raw("POST", f"{base}/v1/completions", data=b"{not json", headers=AUTH)
    assert reply.status == 400 and reply.json()["error"]["code"] == "INVALID_JSON"
    with pytest.raises(openai.BadRequestError) as err:
        _client(base).completions.create(model=model, prompt="x", n=3)
    assert err.value.status_code == 400 and err.value.code == "UNSUPPORTED_PARAMETER"


def test_bearer_token_is_required_on_v1_and_not_on_health(served):
    cluster, base, model, _ = served
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        for method, path in (("GET", "models"), ("POST", "completions")):
            reply = _raw(method, f"{base}/v1/{path}", {"prompt": "x"} if method == "POST"
                         else None, headers)
            assert reply.status == 401, (headers, path)
            assert reply.json()["error"]["code"] == "UNAUTHENTICATED"
    with pytest.raises(openai.AuthenticationError):
        _client(base, key="wrong").completions.create(model=model, prompt="x", max_tokens=2)
    assert _raw("GET", f"{base}/health").status == 200
    metrics = _raw("GET", f"{base}/metrics").text
    assert 'kvhandoff_requests_finished_total{finished_reason="length"' in metrics
    assert 'tenant="unauthenticated"' in metrics  # the refusals counted as gRPC's are


def _events_of(cluster, request_id: str) -> list[str]:
    return [e["event"] for e in log_events(cluster.decode) if e.get("request_id") == request_id]


def _count(cluster, event: str) -> int:
    return sum(e.get("event") == event for e in log_events(cluster.decode))


def test_a_client_that_disconnects_cancels_and_frees_its_pages(served):
    cluster, base, _, _ = served
    finished_before = _count(cluster, "request_finished")
    cancelled_before = _count(cluster, "request_cancelled")
    body = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {**AUTH, "Content-Type": "application/json"})
    reply = conn.getresponse()
    streamed_id = reply.getheader("x-request-id")
    assert reply.status == 200 and reply.readline().startswith(b"data: ")
    conn.close()  # mid-stream
    # a whole (not streamed) request: the client gives up before the answer, which cannot come
    # while prefill is paused (1000 tokens alone take under a second on a quiet host)
    os.kill(cluster.prefill.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(TimeoutError):
            _raw("POST", f"{base}/v1/completions", body, AUTH, timeout=1.0)
    finally:
        os.kill(cluster.prefill.proc.pid, signal.SIGCONT)
    wait_until(lambda: _count(cluster, "request_cancelled") == cancelled_before + 2, 10,
               lambda: "both requests cancelled")
    assert "request_cancelled" in _events_of(cluster, streamed_id)
    assert _count(cluster, "request_finished") == finished_before  # neither ran to its end
    assert_pools_at_baseline(cluster)


def test_eight_concurrent_streams_each_get_their_own_text(served):
    cluster, base, model, _ = served
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0,
                                timeout=120)
    prompts = [f"{PROMPT} {i}" for i in range(4)] * 2  # each prompt twice: same text

    async def one(prompt: str) -> tuple[str, int]:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def run() -> list[tuple[str, int]]:
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert [n for _, n in results] == [16] * 8
    assert results[:4] == results[4:]
    assert len({text for text, _ in results[:4]}) > 1  # four prompts, not one answer
    assert_pools_at_baseline(cluster)


def test_a_seeded_sample_repeats(served):
    _, base, model, _ = served
    client = _client(base)
    args = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0,
            "top_p": 0.9, "seed": 1234, "extra_body": {"top_k": 50, "ignore_eos": True}}
    first, again = (client.completions.create(**args).choices[0].text for _ in range(2))
    assert first == again
    raw = _raw("POST", f"{base}/v1/completions", {
        "prompt": PROMPT, "max_tokens": 3, "cache_salt": "tenant-a"}, AUTH)
    assert raw.status == 200 and raw.json()["usage"]["completion_tokens"] <= 3
