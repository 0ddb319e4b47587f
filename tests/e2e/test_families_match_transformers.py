"""Each supported family (Llama 3.x rope scaling llama3 / yarn / linear, Mistral, Qwen3), served
disaggregated, generates greedily exactly what transformers' generate(do_sample=False) does:
prompts of 1 token, one page, pages plus a remainder and >= 700 tokens (far past the
original_max_position_embeddings of 128, so the rope scaling decides the tokens), solo and in
one concurrent batch; and from text and chat messages, through the tokenizer.json and chat
template each checkpoint ships (Llama-3 style, Mistral byte-fallback with [INST], ChatML)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.pb.kvhandoff.v1 import generate_pb2, generate_pb2_grpc
from tests.helpers.checkpoints import FAMILY_SPECS, hf_greedy, make_checkpoint
from tests.helpers.cluster import generate, start_cluster

pytestmark = pytest.mark.slow

PAGE = 16
LENGTHS = [1, PAGE, 3 * PAGE + 5, 720]
NEW_TOKENS = 8
TEXT = "The quick brown fox, Café 日本語"
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there, how are you?"}]


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def _stream(address: str, request: generate_pb2.GenerateRequest):
    """-> (generated ids, all streamed text, prompt tokens)."""
    ids, text = [], []
    with grpc.insecure_channel(address) as channel:
        for response in generate_pb2_grpc.GenerationServiceStub(channel).Generate(
                request, timeout=120):
            if response.HasField("token"):
                ids.append(response.token.token_id)
                text.append(response.token.text)
            else:
                text.append(response.finished.text)
                return ids, "".join(text), response.finished.usage.prompt_tokens
    raise AssertionError("no finished message")


def _chat(address: str, messages: list[dict]) -> tuple[list[int], int]:
    """-> (generated ids, prompt tokens) of a messages request."""
    request = generate_pb2.GenerateRequest(max_tokens=NEW_TOKENS)
    request.messages.messages.extend(generate_pb2.ChatMessage(**m) for m in messages)
    ids, _, prompt_tokens = _stream(address, request)
    return ids, prompt_tokens


@pytest.mark.parametrize("spec", FAMILY_SPECS, ids=lambda s: s.name)
def test_family_matches_transformers_solo_and_concurrent(spec, tmp_path):
    from transformers import PreTrainedTokenizerFast

    path, hf_model = make_checkpoint(spec, tmp_path)
    hf_tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    prompts = [_prompt(n, spec.vocab, seed=n) for n in LENGTHS]
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    text_ids = hf_tok(TEXT)["input_ids"]
    chat_ids = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                          tokenize=True)["input_ids"]
    cluster = start_cluster(tmp_path / "run", str(path), common_flags=[
        "--dtype", "float32", "--page-size", str(PAGE), "--pool-tokens", "4096",
        "--check-page-owners"])
    try:
        solo = [generate(cluster.address, token_ids=p, max_tokens=NEW_TOKENS).token_ids
                for p in prompts]
        assert solo == expected
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            batch = list(pool.map(lambda p: generate(cluster.address, token_ids=p,
                                                     max_tokens=NEW_TOKENS).token_ids, prompts))
        assert batch == expected
        from_text = generate(cluster.address, text=TEXT, max_tokens=NEW_TOKENS)
        assert from_text.token_ids == hf_greedy(hf_model, text_ids, NEW_TOKENS)
        assert _chat(cluster.address, MESSAGES) == (hf_greedy(hf_model, chat_ids, NEW_TOKENS),
                                                    len(chat_ids))
        ids, text, _ = _stream(cluster.address, generate_pb2.GenerateRequest(
            text=TEXT, max_tokens=32, ignore_eos=True))
        assert text == hf_tok.decode(ids, skip_special_tokens=True)
        cluster.assert_pools_at_baseline()
    finally:
        cluster.stop()


@pytest.mark.parametrize(("extra", "named"), [
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 8}, "mixture-of-experts"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, "sliding-window"),
])
def test_unsupported_checkpoints_are_refused_at_start(tmp_path, extra, named):
    import json
    import subprocess
    import sys

    from tests.helpers.cluster import REPO

    raw = {"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2, "intermediate_size": 16,
           "max_position_embeddings": 32768, **extra}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    out = subprocess.run([sys.executable, "-m", "kvhandoff_cli.main", "prefill", "--model",
                          str(tmp_path), "--port", "0"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 2
    assert "refusing to start" in out.stderr and named in out.stderr
    assert "Traceback" not in out.stderr
