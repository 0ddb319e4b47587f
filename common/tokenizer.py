"""The tokenizer interface and the demo's character tokenizer (a checkpoint's tokenizer files:
common/text/hf_tokenizer.py; streamed text: common/text/detokenizer.py)."""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    """encode/decode between text and ids; decode of a prefix is a prefix of the whole decode
    except for an incomplete multi-byte character at its end."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


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


def __getattr__(name: str):
    """The checkpoint tokenizer and the detokenizer moved to common/text/; the old names still
    import from here (lazily: common/text imports this module)."""
    if name == "HfTokenizer":
        from common.text.hf_tokenizer import HfTokenizer

        return HfTokenizer
    if name == "IncrementalDetokenizer":
        from common.text.detokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
