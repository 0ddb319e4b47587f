"""Streamed text, token by token, whose pieces concatenate to exactly `tokenizer.decode(ids)`.

For the decoders checkpoints ship, the pieces come from each token's own bytes, at constant
work per token (amortized: bytes held back are decoded once):

- ``ByteLevel`` (GPT-2 / Llama 3 / Qwen): a token's characters map back to bytes (a token with
  a character outside the byte alphabet, e.g. an added token, contributes its UTF-8); the byte
  stream goes through one incremental UTF-8 decoder with replacement, so a multi-byte
  character split over tokens appears once it is complete, and invalid bytes become U+FFFD
  exactly where the whole decode puts them;
- a ``Sequence`` of ``Replace`` / ``ByteFallback`` / ``Fuse`` / ``Strip`` (Llama 2 / Mistral):
  a run of <0xXX> tokens is held until it ends (the whole run decodes as UTF-8, or each of its
  bytes is U+FFFD, as ByteFallback does), and the leading space Strip removes is removed once,
  at the start;
- ``Metaspace``: "▁" becomes a space (in the first token it is dropped).

Any other decoder (and the demo's character tokenizer) falls back to decoding a window that
starts at the tokens emitted last: exact when the text decoded up to a token boundary does not
depend on later tokens, but its work grows while text is held back.

Special tokens are skipped and ids outside the vocabulary produce nothing, as in decode.
`finish()` returns what was still held back (an incomplete character at the very end).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable

from common.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


def _byte_level_table() -> dict[str, int]:
    """The GPT-2 byte <-> printable character map, inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


BYTE_LEVEL_CHARS = _byte_level_table()


class _ByteLevelStream:
    """Token strings -> text through the byte alphabet and one incremental UTF-8 decoder."""

    def __init__(self) -> None:
        self.table = BYTE_LEVEL_CHARS
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: str) -> str:
        try:
            data = bytes(self.table[c] for c in token)
        except KeyError:
            data = token.encode("utf-8")
        return self.utf8.decode(data)

    def finish(self) -> str:
        return self.utf8.decode(b"", final=True)


def _byte_token(token: str) -> int | None:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return int(token[3:5], 16)
        except ValueError:
            return None
    return None


class _PieceStream:
    """Replace / ByteFallback / Fuse / Strip (after Fuse) / Metaspace, streamed."""

    def __init__(self, replaces: list[tuple[str, str]], byte_fallback: bool,
                 strip_leading: str) -> None:
        self.replaces = replaces
        self.byte_fallback = byte_fallback
        self.strip_leading = strip_leading  # one leading char stripped from the whole text
        self.run = bytearray()  # held <0xXX> bytes
        self.started = False

    def _text(self, text: str) -> str:
        if not self.started and text:
            self.started = True
            if self.strip_leading and text.startswith(self.strip_leading):
                text = text[len(self.strip_leading):]
        return text

    def _flush_run(self) -> str:
        if not self.run:
            return ""
        try:
            text = self.run.decode("utf-8")
        except UnicodeDecodeError:
            text = REPLACEMENT * len(self.run)
        self.run.clear()
        return text

    def push(self, token: str) -> str:
        for old, new in self.replaces:
            token = token.replace(old, new)
        if self.byte_fallback and (b := _byte_token(token)) is not None:
            self.run.append(b)
            return ""
        return self._text(self._flush_run() + token)

    def finish(self) -> str:
        return self._text(self._flush_run())


class _MetaspaceStream:
    """Metaspace: the replacement character becomes a space, except in the first token, where
    (unless prepend_scheme is "never") every one of them is dropped, as the decoder does."""

    def __init__(self, replacement: str, drop_in_first: bool) -> None:
        self.replacement = replacement
        self.drop_in_first = drop_in_first
        self.first = True

    def push(self, token: str) -> str:
        first, self.first = self.first, False
        return token.replace(self.replacement, "" if first and self.drop_in_first else " ")

    def finish(self) -> str:
        return ""


def _piece_stream(decoder: dict | None):
    """A streaming equivalent of the tokenizer.json decoder, or None when it has none."""
    if decoder is None:
        return None
    if decoder.get("type") == "ByteLevel":
        return _ByteLevelStream()
    if decoder.get("type") == "Metaspace":
        return _MetaspaceStream(decoder.get("replacement", "▁"),
                                decoder.get("prepend_scheme", "always") != "never")
    if decoder.get("type") != "Sequence":
        return None
    replaces, byte_fallback, fused, strip = [], False, False, ""
    for step in decoder.get("decoders", []):
        kind = step.get("type")
        if kind == "Replace" and "String" in step.get("pattern", {}) and not fused:
            if byte_fallback:
                return None  # a Replace after ByteFallback would see decoded bytes
            replaces.append((step["pattern"]["String"], step["content"]))
        elif kind == "ByteFallback" and not fused:
            byte_fallback = True
        elif kind == "Fuse":
            fused = True
        elif kind == "Strip" and fused and step.get("stop", 0) == 0 and not strip:
            strip = step["content"] * min(int(step.get("start", 0)), 1)
        else:
            return None
    return _PieceStream(replaces, byte_fallback, strip)


class _WindowStream:
    """Any decoder: decode from the last emitted token on, emit what grew, hold a trailing
    U+FFFD (it may be an incomplete character)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix_len = 0  # ids[:prefix_len] are emitted
        self.window_start = 0  # the window keeps the last emitted ids as context

    def push_id(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.decode(self.ids[self.window_start:self.prefix_len])
        text = self.decode(self.ids[self.window_start:])
        if text.endswith(REPLACEMENT) or not text.startswith(before):
            return ""
        if self.decode(self.ids[self.prefix_len:]):  # keep context that renders as text
            self.window_start = self.prefix_len
        self.prefix_len = len(self.ids)
        return text[len(before):]

    def finish(self) -> str:
        before = self.decode(self.ids[self.window_start:self.prefix_len])
        text = self.decode(self.ids[self.window_start:])
        self.prefix_len = len(self.ids)
        return text[len(before):]


class IncrementalDetokenizer:
    """push(id) -> the text that id completes; finish() -> the rest. For every id sequence,
    "".join(pieces) + finish() == tokenizer.decode(ids)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        info = getattr(tokenizer, "stream_info", None)
        self._stream = None
        self._window = None
        if info is not None:
            self._stream = _piece_stream(info.decoder)
            self._vocab_size = info.vocab_size
            self._special = info.special_ids
            self._inner = tokenizer.inner
        if self._stream is None and tokenizer is not None:
            self._window = _WindowStream(tokenizer.decode)

    def push(self, token_id: int) -> str:
        if self._stream is not None:
            if token_id in self._special or not 0 <= token_id < self._vocab_size:
                return ""
            token = self._inner.id_to_token(token_id)
            return "" if token is None else self._stream.push(token)
        if self._window is not None:
            return self._window.push_id(token_id)
        return ""

    def finish(self) -> str:
        if self._stream is not None:
            return self._stream.finish()
        if self._window is not None:
            return self._window.finish()
        return ""
