"""Prompt text and chat messages become the ids transformers' PreTrainedTokenizerFast gives
on the same files, and stop strings cut the text exactly before their first occurrence."""

from __future__ import annotations

import json
import random

import grpc
import pytest

from common.errors import ServiceError
from common.pb.kvhandoff.v1 import generate_pb2
from common.text.chat_template import ChatMessage
from common.text.hf_tokenizer import HfTokenizer
from common.text.stop_strings import StopStrings
from decode_svc.validation import chat_prompt_ids, validate_stop_strings
from tests.helpers.tokenizer_files import (
    CHATML_TEMPLATE,
    CORPUS,
    LLAMA3_TEMPLATE,
    MISTRAL_TEMPLATE,
    write_byte_fallback_tokenizer,
    write_llama3_tokenizer,
)

TRICKY = ["", " ", "  two leading", "trailing  ", "\n\n", "Hello <|eot_id|> world",
          "<|begin_of_text|>already", "tabs\tand\nnewlines", "ünïcödé 中文 🙂🙂", "<s></s>x"]


def _pair(root, write):
    from transformers import PreTrainedTokenizerFast

    write(root)
    return HfTokenizer.from_dir(root), PreTrainedTokenizerFast.from_pretrained(str(root))


@pytest.mark.parametrize("write", [write_llama3_tokenizer, write_byte_fallback_tokenizer])
def test_text_ids_and_decode_equal_transformers(tmp_path, write):
    ours, hf = _pair(tmp_path, write)
    for text in CORPUS[:7] + TRICKY:
        assert ours.encode(text) == hf(text)["input_ids"], text
    vocab = len(hf)
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_added_tokens_of_tokenizer_config_are_used(tmp_path):
    """A token only tokenizer_config.json names (added_tokens_decoder, additional specials)
    is matched as one token, as transformers does."""
    write_llama3_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["400"] = {
        "content": "<|python_tag|>", "lstrip": False, "normalized": False, "rstrip": False,
        "single_word": False, "special": True}
    config["additional_special_tokens"] = ["<|eom_id|>"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    from transformers import PreTrainedTokenizerFast

    ours = HfTokenizer.from_dir(tmp_path)
    hf = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    text = "call <|python_tag|>f(x)<|eom_id|> done"
    assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.token_id("<|python_tag|>") in ours.encode(text)
    assert ours.decode(ours.encode(text)) == hf.decode(hf(text)["input_ids"],
                                                       skip_special_tokens=True)


CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Terse."}, {"role": "user", "content": "  padded  "}],
    [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1 日本"},
     {"role": "user", "content": "q2 🙂"}],
]


GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
    "A: {{ m.content | tojson }}{% endgeneration %}{% else %}{{ m.role }}: {{ m.content }}"
    "{% endif %}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}")


@pytest.mark.parametrize("template", [LLAMA3_TEMPLATE, CHATML_TEMPLATE, MISTRAL_TEMPLATE,
                                      GENERATION_TEMPLATE],
                         ids=["llama3", "chatml", "mistral", "generation-tags"])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one", "system", "turns"])
def test_chat_template_renders_and_tokenizes_like_apply_chat_template(tmp_path, template,
                                                                      messages):
    from transformers import PreTrainedTokenizerFast

    write_llama3_tokenizer(tmp_path, template)
    ours = HfTokenizer.from_dir(tmp_path)
    hf = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    as_protos = [generate_pb2.ChatMessage(**m) for m in messages]
    rendered = ours.render_chat([ChatMessage(**m) for m in messages])
    assert rendered == hf.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=False)
    assert chat_prompt_ids(as_protos, ours) == hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)["input_ids"]


def test_chat_template_jinja_file_wins_over_the_config(tmp_path):
    write_llama3_tokenizer(tmp_path, LLAMA3_TEMPLATE)
    (tmp_path / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    rendered = HfTokenizer.from_dir(tmp_path).render_chat([ChatMessage("user", "x")])
    assert rendered.startswith("<|im_start|>system")


def test_no_chat_template_and_template_errors_are_clear(tmp_path):
    write_byte_fallback_tokenizer(tmp_path)
    plain = HfTokenizer.from_dir(tmp_path)
    with pytest.raises(ServiceError) as err:
        chat_prompt_ids([generate_pb2.ChatMessage(role="user", content="x")], plain)
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                  "NO_CHAT_TEMPLATE")
    with pytest.raises(ServiceError) as err:
        chat_prompt_ids([], plain)
    assert err.value.reason == "EMPTY_PROMPT"
    write_llama3_tokenizer(tmp_path / "bad", "{% for m in messages %}{{ m.content }")
    with pytest.raises(ServiceError) as err:
        chat_prompt_ids([generate_pb2.ChatMessage(role="user", content="x")],
                        HfTokenizer.from_dir(tmp_path / "bad"))
    assert err.value.reason == "CHAT_TEMPLATE_ERROR" and "compile" in err.value.message


def _stream(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    matcher = StopStrings(stops)
    sent = []
    for piece in pieces:
        check = matcher.feed(piece)
        sent.append(check.text)
        if check.stopped:
            return sent, True
    check = matcher.finish()
    return sent + [check.text], check.stopped


@pytest.mark.parametrize(("stops", "pieces", "text", "stopped"), [
    (["END"], ["a", "bE", "N", "Dxyz"], "ab", True),  # split over three pieces
    (["END"], ["a", "bE", "N", "x"], "abENx", False),  # a partial match is released
    (["END"], ["abE"], "abE", False),  # held at the end, then sent by finish
    (["ab", "b"], ["xab"], "x", True),  # the earliest occurrence wins
    (["bc", "abcd"], ["a", "b", "c", "d"], "a", True),
    (["aab"], ["a", "a", "a", "b"], "a", True),  # overlapping partial prefixes
    (["\n\n"], ["line\n", "\nnext"], "line", True),
    ([], ["anything"], "anything", False),
    (["日本"], ["x日", "本y"], "x", True),
])
def test_stop_strings(stops, pieces, text, stopped):
    sent, did_stop = _stream(stops, pieces)
    assert "".join(sent) == text and did_stop == stopped


def test_stop_strings_hold_back_at_most_the_longest_stop():
    matcher = StopStrings(["abcdef"])
    for _ in range(1000):
        matcher.feed("abcde")
        assert len(matcher.held) < 6


def test_stop_string_requests_are_validated(tmp_path):
    request = generate_pb2.GenerateRequest(stop=["x"] * 17)
    write_byte_fallback_tokenizer(tmp_path)
    with pytest.raises(ServiceError, match="at most 16"):
        validate_stop_strings(request, HfTokenizer.from_dir(tmp_path))
    with pytest.raises(ServiceError) as err:
        validate_stop_strings(generate_pb2.GenerateRequest(stop=["x"]), None)
    assert err.value.reason == "NO_TOKENIZER"
    assert validate_stop_strings(generate_pb2.GenerateRequest(stop=["", "y"]),
                                 HfTokenizer.from_dir(tmp_path)) == ["y"]
    assert validate_stop_strings(generate_pb2.GenerateRequest(stop=[""]), None) == []


def test_messages_to_the_demo_model_or_no_tokenizer_are_refused_clearly():
    from common.tokenizer import CharTokenizer

    message = [generate_pb2.ChatMessage(role="user", content="x")]
    with pytest.raises(ServiceError) as err:
        chat_prompt_ids(message, CharTokenizer())
    assert err.value.reason == "NO_CHAT_TEMPLATE"
    with pytest.raises(ServiceError) as err:
        chat_prompt_ids(message, None)
    assert err.value.reason == "NO_TOKENIZER"
