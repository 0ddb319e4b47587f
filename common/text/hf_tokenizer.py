"""A checkpoint's tokenizer.json and tokenizer_config.json, used the way transformers'
PreTrainedTokenizerFast (v5) uses them, so that a text prompt gets the same ids:

- the tokenizer.json pipeline (normalizer, pre-tokenizer, model, post-processor) encodes with
  add_special_tokens=True; transformers ignores add_bos_token / add_eos_token in
  tokenizer_config.json when a tokenizer.json exists, and so do we;
- tokens of tokenizer_config.json's added_tokens_decoder that tokenizer.json lacks are added
  (with their lstrip/rstrip/normalized/special flags), and so are named special tokens
  (bos_token, eos_token, ...) and extra/additional special tokens it names but lacks;
- decode skips special tokens; clean_up_tokenization_spaces is not applied (transformers
  ignores it for BPE models too);
- the chat template is chat_template.jinja when present, else tokenizer_config.json's
  chat_template (a string, or the entry named "default" of a list).

Never reads a hub: only the files in the checkpoint directory.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


@dataclass(frozen=True)
class TokenizerFiles:
    """What tokenizer_config.json (and chat_template.jinja) add to tokenizer.json."""

    special_tokens: dict[str, str]  # bos_token -> "<s>", ... (what a chat template sees)
    chat_template: str | None


@dataclass(frozen=True)
class StreamInfo:
    decoder: dict | None  # tokenizer.json's "decoder"
    vocab_size: int  # with added tokens
    special_ids: frozenset[int]  # skipped by decode


def _content(value) -> str | None:
    if value is None:
        return None
    return value["content"] if isinstance(value, dict) else str(value)


def _chat_template(root: Path, config: dict) -> str | None:
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default")
    return template


class HfTokenizer:
    """A `tokenizers` tokenizer from local files; encode/decode as PreTrainedTokenizerFast."""

    def __init__(self, inner, files: TokenizerFiles | None = None) -> None:
        self._inner = inner
        self.files = files or TokenizerFiles({}, None)

    @classmethod
    def from_file(cls, path: Path) -> HfTokenizer:
        """tokenizer.json alone (no tokenizer_config.json beside it is read)."""
        from tokenizers import Tokenizer as _Tokenizer

        return cls(_Tokenizer.from_file(str(path)))

    @classmethod
    def from_dir(cls, root: Path) -> HfTokenizer:
        """root/tokenizer.json plus root/tokenizer_config.json when present."""
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as _Tokenizer

        inner = _Tokenizer.from_file(str(root / "tokenizer.json"))
        config_path = root / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        known = {t.content for t in inner.get_added_tokens_decoder().values()}
        to_add = []
        for _, raw in sorted(config.get("added_tokens_decoder", {}).items(),
                             key=lambda kv: int(kv[0])):
            if raw["content"] not in known:
                flags = {k: raw[k] for k in ("single_word", "lstrip", "rstrip", "normalized",
                                             "special") if k in raw}
                to_add.append(AddedToken(raw["content"], **flags))
                known.add(raw["content"])
        special = {name: _content(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        special = {name: value for name, value in special.items() if value is not None}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
        extra_list = list(extra.values()) if isinstance(extra, dict) else list(extra or [])
        for content in [*special.values(), *(_content(t) for t in extra_list)]:
            if content is not None and content not in known:
                to_add.append(AddedToken(content, special=True, normalized=False))
                known.add(content)
        for token in to_add:
            if token.special:
                inner.add_special_tokens([token])
            else:
                inner.add_tokens([token])
        return cls(inner, TokenizerFiles(special, _chat_template(root, config)))

    @property
    def inner(self):
        """The `tokenizers.Tokenizer` (the detokenizer reads its decoder and vocabulary)."""
        return self._inner

    @property
    def chat_template(self) -> str | None:
        return self.files.chat_template

    @functools.cached_property
    def stream_info(self) -> StreamInfo:
        """What the incremental detokenizer needs, read once (serializing a large
        tokenizer.json takes tens of milliseconds)."""
        decoder = json.loads(self._inner.to_str()).get("decoder")
        special = frozenset(i for i, t in self._inner.get_added_tokens_decoder().items()
                            if t.special)
        return StreamInfo(decoder, self._inner.get_vocab_size(with_added_tokens=True), special)

    @functools.cached_property
    def _compiled_chat_template(self):
        from common.text.chat_template import ChatTemplate, ChatTemplateError

        if self.files.chat_template is None:
            raise ChatTemplateError("the model has no chat template (tokenizer_config.json "
                                    "chat_template or chat_template.jinja); send text instead")
        return ChatTemplate(self.files.chat_template, self.files.special_tokens)

    def render_chat(self, messages, add_generation_prompt: bool = True) -> str:
        """messages: ChatMessage list -> the prompt text; raises ChatTemplateError."""
        return self._compiled_chat_template.render(messages, add_generation_prompt)

    def token_id(self, content: str | None) -> int | None:
        return None if content is None else self._inner.token_to_id(content)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._inner.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._inner.decode(ids, skip_special_tokens=True)
