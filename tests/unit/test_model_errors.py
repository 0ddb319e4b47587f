"""A --model that cannot be served is refused in one line that names the file and the fix:
a missing directory, a regular file, a directory without config.json, a config.json that is
not JSON or lacks a field, and a vocab_size that disagrees with the weights or the tokenizer."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from common.model.config import UnsupportedModelError
from common.model.loader import load_model
from tests.helpers.checkpoints import SPECS, make_checkpoint


def test_a_missing_directory_and_a_regular_file_are_told_apart(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^--model \S+/nope: no such directory"):
        load_model(str(tmp_path / "nope"))
    file = tmp_path / "model.bin"
    file.write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match=r"model.bin: a file, not a directory"):
        load_model(str(file))
    with pytest.raises(FileNotFoundError, match=r"no config.json in it"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("text, says", [
    ("{not json", r"config.json: not valid JSON \(Expecting property name"),
    ("[1, 2]", r"config.json: not a JSON object"),
    (json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 8}),
     r"config.json: no 'num_attention_heads' field"),
    (json.dumps({"architectures": ["LlamaForCausalLM"], "num_attention_heads": "many"}),
     r"config.json: a field has the wrong type"),
])
def test_a_bad_config_json_is_named(tmp_path, text, says):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(UnsupportedModelError, match=says) as caught:
        load_model(str(tmp_path))
    assert str(tmp_path / "config.json") in str(caught.value)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(replace(SPECS[0], name="vocab-check"), tmp_path_factory.mktemp("m"))
    return path


def test_a_vocab_size_that_disagrees_with_the_embedding_is_refused(checkpoint, tmp_path):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    raw = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**raw, "vocab_size": raw["vocab_size"] - 20}))
    with pytest.raises(UnsupportedModelError, match=r"config.json: vocab_size 300 disagrees with "
                       r"the weights: model.embed_tokens.weight has 320 rows"):
        load_model(str(copy))


def test_a_tokenizer_with_ids_past_vocab_size_is_refused(checkpoint, tmp_path):
    import shutil

    from tests.helpers.tokenizer_files import write_tokenizer

    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    size = write_tokenizer(copy, "llama3")
    assert size > 320  # the tokenizer has more ids than the checkpoint's 320 embeddings
    with pytest.raises(UnsupportedModelError, match=rf"tokenizer.json has ids up to {size - 1} "
                       r"but config.json's vocab_size is 320"):
        load_model(str(copy))


def test_the_checkpoint_itself_loads(checkpoint):
    assert load_model(str(checkpoint)).config.vocab_size == 320
