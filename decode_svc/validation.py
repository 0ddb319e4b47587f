"""Decode's checks of a GenerateRequest, against its own limits and the prefill's, before any
page is reserved."""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from common.errors import ServiceError
from common.pb.kvhandoff.v1 import generate_pb2
from common.text.chat_template import ChatMessage, ChatTemplateError
from common.tokenizer import Tokenizer

C = grpc.StatusCode


@dataclass(frozen=True)
class DecodeLimits:
    vocab_size: int
    context_window: int
    own_pool_tokens: int
    prefill_max_prompt: int
    default_max_tokens: int
    # the page size every prefill replica's cache hits are whole multiples of (the gcd of what
    # they advertise in GetPrefillInfo.page_size; 0 when none says)
    prefill_page_size: int = 0


@dataclass(frozen=True)
class ValidPrompt:
    token_ids: list[int]
    max_tokens: int

    @property
    def reserve_tokens(self) -> int:
        """KV slots needed: the prompt plus every generated token but the last."""
        return len(self.token_ids) + self.max_tokens - 1


def prompt_ids(request: generate_pb2.GenerateRequest, tokenizer: Tokenizer | None) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "text":
        if not request.text:  # a tokenizer would make it a lone BOS; nothing was asked
            raise ServiceError(C.INVALID_ARGUMENT, "EMPTY_PROMPT", "the prompt text is empty")
        if tokenizer is None:
            raise ServiceError(C.INVALID_ARGUMENT, "NO_TOKENIZER",
                               "this model has no tokenizer.json; send token_ids instead of text")
        return tokenizer.encode(request.text)
    if kind == "messages":
        return chat_prompt_ids(list(request.messages.messages), tokenizer)
    raise ServiceError(C.INVALID_ARGUMENT, "EMPTY_PROMPT",
                       "the request has neither text nor token_ids")


def chat_prompt_ids(messages, tokenizer: Tokenizer | None) -> list[int]:
    """messages: ChatMessage protos, rendered with the model's chat template."""
    if not messages:
        raise ServiceError(C.INVALID_ARGUMENT, "EMPTY_PROMPT", "the request has no messages")
    if tokenizer is None:
        raise ServiceError(C.INVALID_ARGUMENT, "NO_TOKENIZER",
                           "this model has no tokenizer.json; send token_ids instead of messages")
    render = getattr(tokenizer, "render_chat", None)
    if render is None:
        raise ServiceError(C.INVALID_ARGUMENT, "NO_CHAT_TEMPLATE",
                           "this model's tokenizer has no chat template; send text instead")
    try:
        text = render([ChatMessage(m.role, m.content) for m in messages])
    except ChatTemplateError as err:
        reason = "NO_CHAT_TEMPLATE" if tokenizer.chat_template is None else "CHAT_TEMPLATE_ERROR"
        raise ServiceError(C.INVALID_ARGUMENT, reason, str(err)) from None
    return tokenizer.encode(text, add_special_tokens=False)


MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


def validate_stop_strings(request: generate_pb2.GenerateRequest,
                          tokenizer: Tokenizer | None) -> list[str]:
    stops = [s for s in request.stop if s]
    if not stops:
        return []
    if tokenizer is None:
        raise ServiceError(C.INVALID_ARGUMENT, "NO_TOKENIZER",
                           "this model has no tokenizer.json, so no text to match stop strings "
                           "against; use stop_token_ids")
    longest = max(len(s) for s in stops)
    if len(stops) > MAX_STOP_STRINGS or longest > MAX_STOP_STRING_CHARS:
        raise ServiceError(C.INVALID_ARGUMENT, "BAD_STOP_STRINGS",
                           f"at most {MAX_STOP_STRINGS} stop strings of at most "
                           f"{MAX_STOP_STRING_CHARS} characters; got {len(stops)}, the longest "
                           f"{longest}")
    return stops


def validate_generate(ids: list[int], request: generate_pb2.GenerateRequest,
                      limits: DecodeLimits) -> ValidPrompt:
    n = len(ids)
    if n == 0:
        raise ServiceError(C.INVALID_ARGUMENT, "EMPTY_PROMPT", "the prompt has no tokens")
    bad = next((t for t in ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise ServiceError(C.INVALID_ARGUMENT, "TOKEN_OUT_OF_VOCAB",
                           f"token id {bad} is outside the vocabulary of {limits.vocab_size}")
    if n > limits.context_window:
        raise ServiceError(C.INVALID_ARGUMENT, "PROMPT_TOO_LONG",
                           f"the prompt has {n} tokens, more than the context window of "
                           f"{limits.context_window}")
    if n > limits.prefill_max_prompt:
        raise ServiceError(C.RESOURCE_EXHAUSTED, "POOL_TOO_SMALL",
                           f"the prompt has {n} tokens but the prefill pool holds at most "
                           f"{limits.prefill_max_prompt} tokens for one prompt")
    room = limits.context_window - n + 1
    max_tokens = request.max_tokens or min(limits.default_max_tokens, room)
    if max_tokens > room:  # the last token is sent, never attended to: it needs no position
        raise ServiceError(C.INVALID_ARGUMENT, "MAX_TOKENS_TOO_LARGE",
                           f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) needs "
                           f"{n + max_tokens - 1} positions (the last generated token needs "
                           f"none), {n + max_tokens - 1 - limits.context_window} more than the "
                           f"context window of {limits.context_window}; max_tokens can be at "
                           f"most {room} for this prompt")
    prompt = ValidPrompt(ids, max_tokens)
    if prompt.reserve_tokens > limits.own_pool_tokens:
        raise ServiceError(C.RESOURCE_EXHAUSTED, "POOL_TOO_SMALL",
                           f"the request needs {prompt.reserve_tokens} KV slots but the decode "
                           f"pool holds only {limits.own_pool_tokens} tokens even when empty")
    s = request.sampling
    if not (math.isfinite(s.temperature) and s.temperature >= 0) or not 0 <= s.top_p <= 1:
        raise ServiceError(C.INVALID_ARGUMENT, "BAD_SAMPLING",
                           f"temperature must be >= 0 and top_p in [0, 1]; got "
                           f"{s.temperature}, {s.top_p}")
    return prompt
