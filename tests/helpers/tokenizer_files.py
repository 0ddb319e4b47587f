"""Tokenizer files trained by the tests themselves (nothing downloaded): a byte-level BPE
tokenizer.json in the Llama-3 manner (specials, a post-processor that adds the bos token, a
chat template in tokenizer_config.json), and a byte-fallback BPE in the Llama-2 / Mistral
manner (byte tokens <0x00>..<0xFF>, "▁" for spaces)."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a tiny model that served text.",
    "Serving large language models needs paged KV caches and careful batching.",
    "Café, naïve, résumé, jalapeño, Ångström, Øresund, straße.",
    "日本語のテキストと中文文本，还有한국어 문장도 있습니다。",
    "Emoji: 🙂🚀🎉 👩‍💻 and symbols € £ ¥ © ™ → ∑ ∞.",
    "def generate(prompt):\n    return model(prompt)  # tabs\tand newlines\n",
] * 20

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]

# Llama-3 style: bos, a header per message, content trimmed, the generation prompt at the end.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")

# ChatML (Qwen) style with a default system message, loop.first and a namespace.
CHATML_TEMPLATE = """{%- set ns = namespace(has_system=false) -%}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}{%- set ns.has_system = true -%}{%- endif -%}
{%- endfor -%}
{%- if not ns.has_system -%}
<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif -%}
{%- for message in messages -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}"""


# Mistral style: [INST] ... [/INST] around user turns, eos after assistant turns, the system
# message folded into the first user turn.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}")

TEMPLATES = {"llama3": LLAMA3_TEMPLATE, "chatml": CHATML_TEMPLATE, "mistral": MISTRAL_TEMPLATE}


def train_byte_level(vocab_size: int = 400):
    """A trained byte-level BPE `tokenizers.Tokenizer` with the Llama-3 specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=LLAMA3_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    return tok


def train_byte_fallback(vocab_size: int = 300):
    """A BPE with byte fallback (Llama-2 / Mistral manner): only ASCII and a few accented
    letters are in the vocabulary, everything else falls back to <0xXX> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    ascii_corpus = [line for line in CORPUS if line.isascii() or "Café" in line]
    base = Tokenizer(models.BPE())
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                            normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    base.train_from_iterator(ascii_corpus, trainer)
    trained = json.loads(base.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for token, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = base.normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<unk>", "<s>", "</s>")])
    return tok


def write_llama3_tokenizer(root: Path, template: str = LLAMA3_TEMPLATE) -> int:
    """Writes tokenizer.json and tokenizer_config.json (with the chat template) into root;
    returns the vocabulary size including added tokens."""
    tok = train_byte_level()
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    decoder = {str(i): {"content": t.content, "lstrip": False, "normalized": False,
                        "rstrip": False, "single_word": False, "special": True}
               for i, t in tok.get_added_tokens_decoder().items()}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True,
              "model_max_length": 1024, "added_tokens_decoder": decoder,
              "chat_template": template}
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return tok.get_vocab_size(with_added_tokens=True)


def write_byte_fallback_tokenizer(root: Path, template: str | None = None) -> int:
    """tokenizer.json (no post-processor: transformers adds no bos to a text prompt, whatever
    add_bos_token says) and tokenizer_config.json, with the chat template when given."""
    tok = train_byte_fallback()
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
    if template is not None:
        config["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size(with_added_tokens=True)


def write_tokenizer(root: Path, style: str) -> int:
    """style: "llama3" or "chatml" (byte-level BPE), "mistral" (byte fallback); -> vocab size."""
    if style == "mistral":
        return write_byte_fallback_tokenizer(root, MISTRAL_TEMPLATE)
    return write_llama3_tokenizer(root, TEMPLATES[style])
