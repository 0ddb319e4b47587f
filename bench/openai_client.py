"""The OpenAI-compatible backend of `kvhandoff bench serve`: the same requests as the gRPC one,
sent as streaming `/v1/completions` with only the API's standard fields plus `ignore_eos` (which
vLLM and our decode accept), timed by the same RequestResult.

A request asks for `max_tokens` at temperature 0 with end of sequence ignored and
`stream_options.include_usage`, so the server's own count of generated tokens arrives with the
last chunk. Each streamed choice is one token's arrival (servers stream a chunk per step). The
usage count is the truth when it comes: trailing empty choices that only carry finish_reason
beyond it are not tokens, and tokens beyond the choices are counted at the last chunk's time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

from bench.serve_client import RequestResult, RequestSpec, Send


class OpenAiError(RuntimeError):
    """The server cannot be used for the run (unreachable, no model listed)."""


def completion_body(model: str, prompt: list[int] | str, max_tokens: int) -> dict:
    """The request: greedy, streamed, exactly max_tokens generated (EOS ignored)."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


def token_times(arrivals: list[tuple[float, str, str | None]], usage_tokens: int | None
                ) -> list[float]:
    """One time per generated token from the chunks' (time, text, finish_reason) and the
    server's completion_tokens (None when it sent no usage)."""
    times = [t for t, _text, _finish in arrivals]
    expected = len(times) if usage_tokens is None else usage_tokens
    while len(times) > max(expected, 0) and arrivals[len(times) - 1][1] == "" \
            and arrivals[len(times) - 1][2] is not None:
        times.pop()  # an empty closing choice (finish_reason only) is not a token
    if usage_tokens is not None and len(times) < usage_tokens and times:
        times += [times[-1]] * (usage_tokens - len(times))
    return times


async def stream_completion(session, url: str, body: dict, prompt_len: int,
                            timeout: float) -> RequestResult:
    """POSTs one streaming completion and times each token's arrival from the send."""
    import aiohttp

    result = RequestResult(prompt_len, body["max_tokens"])
    arrivals: list[tuple[float, str, str | None]] = []
    usage_tokens: int | None = None
    finish: str | None = None
    started = time.perf_counter()
    result.sent_at = started
    try:
        async with session.post(f"{url}/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                text = (await response.text()).strip().replace("\n", " ")
                result.error = f"HTTP {response.status}: {text[:300]}"
            else:
                async for raw in response.content:  # one line at a time
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    now = time.perf_counter() - started
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = f"server error: {json.dumps(chunk['error'])[:300]}"
                        break
                    for choice in chunk.get("choices") or []:
                        finish = choice.get("finish_reason") or finish
                        arrivals.append((now, choice.get("text") or "",
                                         choice.get("finish_reason")))
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"].get("completion_tokens")
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as err:
        result.error = f"{type(err).__name__}: {err}"
    result.latency = time.perf_counter() - started
    result.token_times = token_times(arrivals, usage_tokens)
    if not result.error and finish == "stop" and result.output_len < result.max_tokens:
        result.error = (f"the server stopped at {result.output_len} of {result.max_tokens} "
                        "tokens (finish_reason stop): it does not honour ignore_eos")
    return result


async def served_model(session, url: str) -> str:
    """The first model GET /models lists."""
    import aiohttp

    try:
        async with session.get(f"{url}/models",
                               timeout=aiohttp.ClientTimeout(total=30)) as response:
            if response.status != 200:
                raise OpenAiError(f"GET {url}/models answered HTTP {response.status}")
            listed = (await response.json()).get("data") or []
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
        raise OpenAiError(f"cannot list the models at {url}: {type(err).__name__}: {err}") \
            from err
    if not listed:
        raise OpenAiError(f"{url}/models lists no model; pass --served-model")
    return str(listed[0]["id"])


class OpenAiBackend:
    """An OpenAI-compatible server at `url` (ending in /v1). prompt_format 'ids' sends the
    prompt's token ids; 'text' sends them decoded by `tokenizer_dir`'s tokenizer.json (the
    server re-tokenizes, so its prompt length may differ by a few tokens)."""

    def __init__(self, url: str, model: str = "", prompt_format: str = "ids",
                 tokenizer_dir: str = "", label: str = "openai") -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.label = label
        self._decode = None
        if prompt_format == "text":
            from tokenizers import Tokenizer

            path = Path(tokenizer_dir) / "tokenizer.json"
            if not path.is_file():
                raise OpenAiError(f"--prompt-format text needs {path}; pass --model DIR")
            self._decode = Tokenizer.from_file(str(path)).decode
        elif prompt_format != "ids":
            raise OpenAiError(f"prompt format {prompt_format!r}: choose ids or text")

    def prompt(self, spec: RequestSpec) -> list[int] | str:
        return spec.token_ids if self._decode is None else self._decode(spec.token_ids)

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[Send]:
        import aiohttp

        # no cap on connections: the load's own concurrency is the only limit
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            model = self.model or await served_model(session, self.url)

            async def send(spec: RequestSpec, timeout: float) -> RequestResult:
                body = completion_body(model, self.prompt(spec), spec.max_tokens)
                return await stream_completion(session, self.url, body, len(spec.token_ids),
                                               timeout)

            yield send
