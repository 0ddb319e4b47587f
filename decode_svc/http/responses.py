"""OpenAI response objects for one request: completions (`text_completion`) and chat
(`chat.completion`, `chat.completion.chunk`), whole or as server-sent-event chunks.

`usage.prompt_tokens_details.cached_tokens` is what prefill's 1.2 commit reported it served
from its prefix cache, after decode bounded it (SPEC.md D-90: whole pages, fewer than the
prompt's tokens); 0 from a 1.1 prefill. Decode verifies every handoff in full either way.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from decode_svc.lifecycle import Finished


def usage(finished: Finished) -> dict:
    return {"prompt_tokens": finished.prompt_tokens,
            "completion_tokens": finished.completion_tokens,
            "total_tokens": finished.prompt_tokens + finished.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": finished.cached_tokens}}


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


@dataclass
class Reply:
    """The objects of one request; `chat` picks the chat shapes."""

    chat: bool
    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, finished: Finished) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finished.reason}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": finished.reason}
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": usage(finished)}

    def _chunk(self, delta_text: str | None, finish_reason: str | None,
               role: bool = False) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant"} if role else {}
            if delta_text is not None:
                delta["content"] = delta_text
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": delta_text or "", "logprobs": None,
                  "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def first_chunk(self) -> bytes:
        """Chat streams open with the assistant's role (as OpenAI's do); completions send
        nothing before the first text."""
        return sse(self._chunk("", None, role=True)) if self.chat else b""

    def text_chunk(self, text: str) -> bytes:
        return sse(self._chunk(text, None))

    def final_chunks(self, text: str, finished: Finished, include_usage: bool) -> bytes:
        """The held-back text (if any), the finish reason, the usage chunk when asked, and
        [DONE]."""
        out = self.text_chunk(text) if text else b""
        out += sse(self._chunk(None if self.chat else "", finished.reason))
        if include_usage:
            out += sse({**self._head("chat.completion.chunk" if self.chat
                                     else "text_completion"),
                        "choices": [], "usage": usage(finished)})
        return out + DONE
