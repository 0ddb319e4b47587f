"""OpenAI request bodies -> the GenerateRequest the lifecycle admits (the same message a gRPC
client sends, so both front doors pass the same checks in decode_svc.validation).

Only type and shape are checked here; limits (context window, pool, stop strings, sampling
ranges) are the lifecycle's. Features decode does not implement (n > 1, logprobs, tools,
penalties, ...) are refused with a 400 naming the field, never silently ignored; fields that
change nothing here (user, metadata, store, ...) are ignored, as vLLM ignores unknown ones.
Defaults follow OpenAI: temperature 1 and top_p 1 when absent.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import ServiceError
from common.pb.kvhandoff.v1 import generate_pb2
from decode_svc.http.errors import bad_request

INVALID = "INVALID_PARAMETER"
UNSUPPORTED = "UNSUPPORTED_PARAMETER"
_MISSING = object()


@dataclass(frozen=True)
class OpenAiRequest:
    generate: generate_pb2.GenerateRequest
    stream: bool
    include_usage: bool
    model: str | None


def _typed(body: dict, name: str, kinds: tuple[type, ...], words: str):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise bad_request(INVALID, f"'{name}' must be {words}, got {type(value).__name__} "
                          f"{str(value)[:40]!r}", name)
    return value


def _int(body: dict, name: str) -> int | None:
    return _typed(body, name, (int,), "an integer")


def _number(body: dict, name: str) -> float | None:
    value = _typed(body, name, (int, float), "a number")
    return None if value is None else float(value)


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """Refuses, naming the field, every feature that would change the answer but is not built."""
    def refuse(name: str, what: str) -> ServiceError:
        return bad_request(UNSUPPORTED, f"{what} is not supported by kvhandoff", name)

    n = _int(body, "n")
    if n is not None and n != 1:
        raise refuse("n", "n other than 1 (send one request per completion)")
    best_of = _int(body, "best_of")
    if best_of is not None and best_of != 1:
        raise refuse("best_of", "best_of other than 1")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise refuse("logprobs" if body.get("logprobs") not in (None, False) else "top_logprobs",
                     "logprobs")
    for name in ("tools", "functions"):
        if body.get(name):
            raise refuse(name, "tool calling")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise refuse(name, "tool calling")
    if body.get("echo"):
        raise refuse("echo", "echo")
    if body.get("suffix"):
        raise refuse("suffix", "suffix")
    if body.get("logit_bias"):
        raise refuse("logit_bias", "logit_bias")
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0),
                          ("repetition_penalty", 1), ("min_p", 0), ("min_tokens", 0)):
        value = _number(body, name)
        if value is not None and value != neutral:
            raise refuse(name, name)
    response_format = body.get("response_format")
    if response_format not in (None, {}) and (not isinstance(response_format, dict)
                                              or response_format.get("type") != "text"):
        raise refuse("response_format", "a response_format other than text")
    if not chat and body.get("prompt_logprobs"):
        raise refuse("prompt_logprobs", "prompt_logprobs")


def _prompt(body: dict, request: generate_pb2.GenerateRequest) -> None:
    """completions: a string, a list of token ids, or a list of one of either."""
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING or prompt is None:
        raise bad_request(INVALID, "'prompt' is required", "prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request(UNSUPPORTED, f"a list of {len(prompt)} prompts is not supported; "
                              "send one request per prompt", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                          and t >= 0 for t in prompt):
        request.token_ids.ids.extend(prompt)
    else:
        raise bad_request(INVALID, "'prompt' must be a string or a list of token ids "
                          "(non-negative integers)", "prompt")


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(UNSUPPORTED, f"messages[{i}]: content part {kind!r} is not "
                                  "supported; only text parts are", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(INVALID, f"messages[{i}].content must be a string or a list of text "
                      "parts", "messages")


def _messages(body: dict, request: generate_pb2.GenerateRequest) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request(INVALID, "'messages' must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(INVALID, f"messages[{i}] must be an object with a string 'role'",
                              "messages")
        request.messages.messages.append(generate_pb2.ChatMessage(
            role=message["role"], content=_content(message, i)))


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise bad_request(INVALID, "'stop' must be a string or a list of strings", "stop")


def _sampling(body: dict, request: generate_pb2.GenerateRequest) -> None:
    temperature, top_p = _number(body, "temperature"), _number(body, "top_p")
    request.sampling.temperature = 1.0 if temperature is None else temperature
    request.sampling.top_p = 1.0 if top_p is None else top_p
    top_k = _int(body, "top_k")
    if top_k is not None and top_k < -1:
        raise bad_request(INVALID, f"'top_k' must be -1 or 0 (off) or positive, got {top_k}",
                          "top_k")
    request.sampling.top_k = max(0, top_k or 0)
    seed = _int(body, "seed")
    if seed is not None:
        request.sampling.seed = seed % (1 << 64)
        request.sampling.has_seed = True


def parse_request(body: object, chat: bool) -> OpenAiRequest:
    """A parsed JSON body of /v1/completions (chat=False) or /v1/chat/completions."""
    if not isinstance(body, dict):
        raise bad_request(INVALID, "the request body must be a JSON object")
    _refuse_unsupported(body, chat)
    request = generate_pb2.GenerateRequest()
    (_messages if chat else _prompt)(body, request)
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name in names:
        max_tokens = _int(body, name)
        if max_tokens is not None:
            if max_tokens < 1:
                raise bad_request(INVALID, f"'{name}' must be at least 1, got {max_tokens}", name)
            request.max_tokens = max_tokens
            break
    _sampling(body, request)
    request.stop.extend(_stops(body))
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids):
        raise bad_request(INVALID, "'stop_token_ids' must be a list of token ids",
                          "stop_token_ids")
    request.stop_token_ids.extend(stop_ids)
    request.ignore_eos = bool(_typed(body, "ignore_eos", (bool,), "true or false"))
    request.cache_salt = _typed(body, "cache_salt", (str,), "a string") or ""
    stream = bool(_typed(body, "stream", (bool,), "true or false"))
    options = _typed(body, "stream_options", (dict,), "an object")
    if options is not None and not stream:
        raise bad_request(INVALID, "'stream_options' is only allowed when 'stream' is true",
                          "stream_options")
    include_usage = bool(_typed(options or {}, "include_usage", (bool,), "true or false"))
    model = _typed(body, "model", (str,), "a string")
    return OpenAiRequest(request, stream, include_usage, model)
