"""Decode's refusals say what is true: the window message's numbers add up, and an empty text
prompt is EMPTY_PROMPT (as the README's table says), not a generation from a lone BOS."""

from __future__ import annotations

import re

import pytest

from common.errors import ServiceError
from common.pb.kvhandoff.v1 import generate_pb2
from common.tokenizer import CharTokenizer
from decode_svc.validation import DecodeLimits, prompt_ids, validate_generate

LIMITS = DecodeLimits(vocab_size=98, context_window=64, own_pool_tokens=4096,
                      prefill_max_prompt=64, default_max_tokens=16)


def request(max_tokens: int) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(max_tokens=max_tokens)


@pytest.mark.parametrize("n, max_tokens", [(10, 60), (64, 2), (1, 65), (40, 100)])
def test_the_window_message_adds_up(n, max_tokens):
    with pytest.raises(ServiceError) as err:
        validate_generate([5] * n, request(max_tokens), LIMITS)
    assert err.value.reason == "MAX_TOKENS_TOO_LARGE"
    text = err.value.message
    needed = int(re.search(r"needs (\d+) positions", text).group(1))
    over = int(re.search(r"(\d+) more than the context window of (\d+)", text).group(1))
    window = int(re.search(r"context window of (\d+)", text).group(1))
    most = int(re.search(r"at most (\d+)", text).group(1))
    assert f"({n} tokens)" in text and f"max_tokens ({max_tokens})" in text
    assert needed == n + max_tokens - 1 and needed - over == window == LIMITS.context_window
    # the limit it names is the real one: exactly `most` passes, one more is refused
    assert validate_generate([5] * n, request(most), LIMITS).max_tokens == most
    with pytest.raises(ServiceError):
        validate_generate([5] * n, request(most + 1), LIMITS)


def test_empty_text_is_an_empty_prompt():
    empty = generate_pb2.GenerateRequest(text="")
    assert empty.WhichOneof("prompt") == "text"
    with pytest.raises(ServiceError) as err:
        prompt_ids(empty, CharTokenizer())
    assert err.value.reason == "EMPTY_PROMPT"


def test_text_that_is_not_empty_is_tokenized():
    assert prompt_ids(generate_pb2.GenerateRequest(text="ab"), CharTokenizer())
