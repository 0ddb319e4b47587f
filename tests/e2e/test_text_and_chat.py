"""Text in, text out on a served Llama-3.1-style checkpoint with a trained byte-level
tokenizer.json and a chat template: prompt ids equal transformers' (text and messages), the
generation equals transformers' greedy generation on those ids, the streamed text concatenates
to tokenizer.decode of the ids, stop strings end the text right before them, and
`kvhandoff generate --system/--user` sends messages."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from common.errors import error_reason
from common.pb.kvhandoff.v1 import generate_pb2, generate_pb2_grpc
from tests.helpers.checkpoints import hf_greedy, make_chat_checkpoint
from tests.helpers.cluster import REPO, start_cluster

pytestmark = pytest.mark.slow

TEXTS = ["The quick brown fox", "Café 日本語 🙂", "x"]
MESSAGES = [
    [{"role": "user", "content": "Hello there, how are you?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " 中文 text "}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    path, hf_model, hf_tok = make_chat_checkpoint(root)
    cluster = start_cluster(root / "run", str(path), common_flags=[
        "--dtype", "float32", "--page-size", "16", "--pool-tokens", "4096"])
    yield cluster, hf_model, hf_tok
    cluster.stop()


def _run(address: str, request: generate_pb2.GenerateRequest):
    """-> (token ids, token texts, finished message)."""
    ids, texts = [], []
    with grpc.insecure_channel(address) as channel:
        for response in generate_pb2_grpc.GenerationServiceStub(channel).Generate(
                request, timeout=120):
            if response.HasField("token"):
                ids.append(response.token.token_id)
                texts.append(response.token.text)
            else:
                return ids, texts, response.finished
    raise AssertionError("no finished message")


def _chat_request(messages, **kwargs) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(**kwargs)
    request.messages.messages.extend(generate_pb2.ChatMessage(**m) for m in messages)
    return request


@pytest.mark.parametrize("text", TEXTS)
def test_text_prompt_ids_and_generation_match_transformers(served, text):
    cluster, hf_model, hf_tok = served
    prompt = hf_tok(text)["input_ids"]
    assert prompt[0] == hf_tok.bos_token_id  # the post-processor's bos is there
    ids, _, finished = _run(cluster.address, generate_pb2.GenerateRequest(text=text,
                                                                          max_tokens=8))
    assert finished.usage.prompt_tokens == len(prompt)
    assert ids == hf_greedy(hf_model, prompt, 8)


@pytest.mark.parametrize("messages", MESSAGES, ids=["user", "system-user", "multi-turn"])
def test_messages_render_like_apply_chat_template(served, messages):
    cluster, hf_model, hf_tok = served
    prompt = hf_tok.apply_chat_template(messages, add_generation_prompt=True,
                                        tokenize=True)["input_ids"]
    ids, _, finished = _run(cluster.address, _chat_request(messages, max_tokens=8))
    assert finished.usage.prompt_tokens == len(prompt)
    assert ids == hf_greedy(hf_model, prompt, 8)


def test_streamed_text_concatenates_to_the_decode_of_the_ids(served):
    """Random weights emit split multi-byte characters and invalid byte runs."""
    cluster, _, hf_tok = served
    for text in TEXTS:
        ids, texts, finished = _run(cluster.address, generate_pb2.GenerateRequest(
            text=text, max_tokens=48, ignore_eos=True))
        assert len(ids) == 48
        assert "".join(texts) + finished.text == hf_tok.decode(ids, skip_special_tokens=True)


def test_stop_string_ends_the_text_right_before_it(served):
    cluster, _, hf_tok = served
    base = {"text": "Once upon a time", "max_tokens": 40, "ignore_eos": True}
    full_ids, texts, finished = _run(cluster.address, generate_pb2.GenerateRequest(**base))
    full = "".join(texts) + finished.text
    start = next(i for i in range(len(full) // 3, len(full) - 2)
                 if "\ufffd" not in full[i:i + 2] and full[i:i + 2].strip())
    stop = full[start:start + 2]
    cut = full.find(stop)
    ids, texts, finished = _run(cluster.address, generate_pb2.GenerateRequest(
        **base, stop=["never appears \u2603\u2603", stop]))
    assert "".join(texts) + finished.text == full[:cut]
    assert finished.finish_reason == generate_pb2.FINISH_REASON_STOP
    assert ids == full_ids[:len(ids)] and len(ids) < len(full_ids)
    assert finished.usage.completion_tokens == len(ids)
    decoded = hf_tok.decode(ids, skip_special_tokens=True)
    assert stop in decoded and stop not in hf_tok.decode(ids[:-1], skip_special_tokens=True)
    cluster.assert_pools_at_baseline()


def test_a_role_the_template_refuses_is_invalid_argument(served):
    cluster, _, _ = served
    with pytest.raises(grpc.RpcError) as err:
        _run(cluster.address, _chat_request([{"role": "tool", "content": "x"}], max_tokens=4))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason(err.value) == "CHAT_TEMPLATE_ERROR"
    assert "unknown role tool" in err.value.details()


def test_cli_system_and_user_send_messages(served):
    cluster, hf_model, hf_tok = served
    messages = MESSAGES[1]
    expected = hf_greedy(hf_model, hf_tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)["input_ids"], 6)
    out = subprocess.run(
        [sys.executable, "-m", "kvhandoff_cli.main", "generate", "--target", cluster.address,
         "--system", messages[0]["content"], "--user", messages[1]["content"],
         "--max-tokens", "6", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["token_ids"] == expected
