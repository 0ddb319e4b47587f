"""The streamed pieces concatenate to exactly tokenizer.decode(all ids), for byte-level and
byte-fallback tokenizers, with multi-byte characters split over tokens, invalid bytes, special
tokens and ids outside the vocabulary; and the work per token does not grow with the text."""

from __future__ import annotations

import random

import pytest

from common.text.detokenizer import IncrementalDetokenizer
from common.text.hf_tokenizer import HfTokenizer
from common.tokenizer import CharTokenizer
from tests.helpers.tokenizer_files import (
    CORPUS,
    write_byte_fallback_tokenizer,
    write_llama3_tokenizer,
)


STYLES = ["byte_level", "byte_fallback", "added_tokens", "metaspace_first", "metaspace_never",
          "window"]


@pytest.fixture(scope="module", params=STYLES)
def tokenizer(request, tmp_path_factory):
    """added_tokens: byte-level plus non-special added tokens whose text is outside the byte
    alphabet (they decode as their own UTF-8); metaspace_*: a Metaspace decoder; window: a
    decoder without a streaming equivalent here (a Metaspace inside a Sequence), so the
    detokenizer decodes windows."""
    from tokenizers import AddedToken, decoders

    root = tmp_path_factory.mktemp(request.param)
    byte_level = request.param in ("byte_level", "added_tokens")
    write = write_llama3_tokenizer if byte_level else write_byte_fallback_tokenizer
    write(root)
    tok = HfTokenizer.from_dir(root)
    if request.param == "added_tokens":
        tok.inner.add_tokens([AddedToken(" ü x ", special=False), AddedToken("plain")])
    elif request.param.startswith("metaspace"):
        tok.inner.decoder = decoders.Metaspace(prepend_scheme=request.param.split("_")[1])
    elif request.param == "window":
        tok.inner.decoder = decoders.Sequence([decoders.Metaspace(prepend_scheme="first")])
    return tok


def _stream(tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    return [detok.push(i) for i in ids] + [detok.finish()]


def test_text_round_trips_piece_by_piece(tokenizer):
    for text in CORPUS[:7]:
        ids = tokenizer.encode(text)
        pieces = _stream(tokenizer, ids)
        assert "".join(pieces) == tokenizer.decode(ids)
        assert all("\ufffd" not in p for p in pieces)  # nothing half-decoded was sent
        if tokenizer.stream_info.decoder["type"] in ("ByteLevel",):
            assert "".join(pieces).strip() == text.strip()


def test_random_ids_concatenate_to_the_whole_decode(tokenizer):
    """Random ids (as a random model emits): split characters, invalid byte runs, specials."""
    vocab = tokenizer.inner.get_vocab_size(with_added_tokens=True)
    rng = random.Random(0)
    for trial in range(300):
        ids = [rng.randrange(vocab + 3) for _ in range(rng.randrange(1, 40))]
        pieces = _stream(tokenizer, ids)
        assert "".join(pieces) == tokenizer.decode(ids), (trial, ids)


def test_byte_runs_of_a_multibyte_character(tokenizer):
    """A character whose bytes arrive one token at a time appears once, when complete."""
    text = "日本語 🙂 Ångström"
    ids = tokenizer.encode(text)
    pieces = _stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert "" in pieces  # something was held back mid-character
    assert any(len(p.encode()) > 1 for p in pieces if p)


def test_demo_character_tokenizer_streams_too():
    tok = CharTokenizer()
    ids = tok.encode("hello, world")
    assert "".join(_stream(tok, ids)) == tok.decode(ids)


def test_work_per_token_does_not_grow_with_the_text(tokenizer, monkeypatch):
    """The byte streams never call decode: each token's bytes are decoded once."""
    if tokenizer.stream_info.decoder["type"] == "Sequence" and \
            tokenizer.stream_info.decoder["decoders"][-1]["type"] == "Metaspace":
        pytest.skip("the window fallback decodes by design")
    calls = []
    monkeypatch.setattr(tokenizer, "decode", lambda ids: calls.append(len(ids)) or "")
    ids = tokenizer.encode(" ".join(CORPUS[:7]) * 5)
    _stream(tokenizer, ids)
    assert calls == []
