"""`kvhandoff generate --chat / --system / --user / --stop` build the request they say."""

from __future__ import annotations

import argparse

import pytest

from kvhandoff_cli.generate import build_request, generate


def _args(**kw) -> argparse.Namespace:
    base = {"prompt": None, "token_ids": None, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
            "seed": None, "max_tokens": 0, "ignore_eos": False, "stop_token_ids": "",
            "stop": [], "chat": False, "system": None, "user": None}
    return argparse.Namespace(**{**base, **kw})


def test_chat_sends_the_prompt_as_a_user_message():
    request = build_request(_args(prompt="hi", chat=True, system="be brief", stop=["\n", "##"]))
    assert request.WhichOneof("prompt") == "messages"
    assert [(m.role, m.content) for m in request.messages.messages] == [
        ("system", "be brief"), ("user", "hi")]
    assert list(request.stop) == ["\n", "##"]


def test_user_implies_chat_and_a_plain_prompt_stays_text():
    request = build_request(_args(user="question"))
    assert [(m.role, m.content) for m in request.messages.messages] == [("user", "question")]
    assert build_request(_args(prompt="plain")).text == "plain"


@pytest.mark.parametrize("argv", [["hi", "--user", "x"], ["--system", "s", "hi"], []])
def test_conflicting_or_missing_prompts_are_usage_errors(argv):
    with pytest.raises(SystemExit) as err:
        generate(argv)
    assert err.value.code == 2
