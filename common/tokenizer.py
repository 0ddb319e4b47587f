"""Tokenizers: a wrapper of a checkpoint's tokenizer.json and the demo's character tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    """encode/decode between text and ids; decode of a prefix is a prefix of the whole decode
    except for an incomplete multi-byte character at its end."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class HfTokenizer:
    """A `tokenizers` tokenizer loaded from a local tokenizer.json (never from a hub)."""

    def __init__(self, inner) -> None:
        self._inner = inner

    @classmethod
    def from_file(cls, path: Path) -> HfTokenizer:
        from tokenizers import Tokenizer as _Tokenizer

        return cls(_Tokenizer.from_file(str(path)))

    def encode(self, text: str) -> list[int]:
        return self._inner.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._inner.decode(ids, skip_special_tokens=True)


class CharTokenizer:
    """One id per printable ASCII character after the special ids; other characters map to '?'."""

    SPECIALS = ("<bos>", "<eos>")
    ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"

    def __init__(self) -> None:
        self.offset = len(self.SPECIALS)
        self.bos_id, self.eos_id = 0, 1
        self._index = {ch: i + self.offset for i, ch in enumerate(self.ALPHABET)}

    @property
    def vocab_size(self) -> int:
        return self.offset + len(self.ALPHABET)

    def encode(self, text: str) -> list[int]:
        unknown = self._index["?"]
        return [self.bos_id] + [self._index.get(ch, unknown) for ch in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.ALPHABET[i - self.offset] for i in ids if i >= self.offset)


class IncrementalDetokenizer:
    """Turns a growing id list into text pieces; holds back a trailing replacement character."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return piece
