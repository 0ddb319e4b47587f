"""What a new user meets before any service runs: help for every flag with its default,
`--version`, one-line errors (never a traceback) for bad client input, secrets kept out of
`config show`, default ports that agree with docs/operations.md, and a client that starts
without torch."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import socket
import subprocess
import sys

import pytest

from bench.cli import BENCHMARKS
from kvhandoff_cli import generate, up
from kvhandoff_cli.main import _service_parser, main
from tests.helpers.cluster import REPO


class Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def capture_parser(monkeypatch, run) -> argparse.ArgumentParser:
    """The parser a command builds, caught where it would parse its arguments."""
    def stop(self, *args, **kwargs):
        raise Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", stop)
    with pytest.raises(Captured) as caught:
        run()
    return caught.value.parser


def all_parsers(monkeypatch) -> dict[str, argparse.ArgumentParser]:
    parsers = {"up": up.parser(), "generate": generate.parser(),
               "prefill": _service_parser("prefill"), "decode": _service_parser("decode")}
    parsers["health"] = capture_parser(monkeypatch, lambda: main(["health", "x:1"]))
    parsers["config show"] = capture_parser(monkeypatch,
                                            lambda: main(["config", "show", "decode"]))
    for name, (module, _text) in BENCHMARKS.items():
        bench = importlib.import_module(module)
        parsers[f"bench {name}"] = capture_parser(monkeypatch, lambda b=bench: b.main([]))
    return parsers


def test_every_flag_of_every_command_has_help_and_its_default(monkeypatch):
    """(`kvhandoff conformance` is checked by its own package's tests.)"""
    missing = []
    for command, parser in all_parsers(monkeypatch).items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            name = "/".join(action.option_strings) or action.dest
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{command} {name}: no help")
            elif action.option_strings and "%(default)" not in formatter._get_help_string(
                    action):
                missing.append(f"{command} {name}: help does not show the default")
    assert missing == []


def test_descriptions_are_whole_sentences(monkeypatch):
    for command, parser in all_parsers(monkeypatch).items():
        text = " ".join((parser.description or "").split())
        assert text[:1].isupper() or text.startswith("`"), (command, text)
        assert text.endswith("."), (command, text)
    for name, (_module, text) in BENCHMARKS.items():
        assert text[:1].isupper() and text.endswith("."), (name, text)


def test_version(capsys):
    assert main(["--version"]) == 0
    assert re.fullmatch(r"kvhandoff \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)


def test_health_help_names_the_command(capsys):
    with pytest.raises(SystemExit) as done:
        main(["health", "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage: kvhandoff health ")


@pytest.mark.parametrize("flags, says", [
    (["--token-ids", "1,-2"], "-2 is not a token id"),
    (["--token-ids", "1,x"], "'x' is not a token id"),
    (["--token-ids", str(2**32)], "is not a token id"),
    (["--max-tokens", "-1", "hi"], "--max-tokens: -1 is not a whole number"),
    (["--max-tokens", "ten", "hi"], "--max-tokens: 'ten' is not a whole number"),
    (["--top-k", "-3", "hi"], "--top-k: -3 is not a whole number"),
    (["--stop-token-ids", "1,z", "hi"], "--stop-token-ids: 'z' is not a token id"),
    (["--seed", "-1", "hi"], "--seed: -1 is not a seed"),
    (["--target", "localhost", "hi"], "'localhost' is not HOST:PORT"),
    (["--target", "[::1]", "hi"], "is not HOST:PORT"),
    (["--timeout", "0", "hi"], "--timeout: 0 must be > 0"),
    ([], "give a PROMPT, --token-ids or --user\n"),
    (["hi", "--token-ids", "1"], "give one of PROMPT, --token-ids or --user, not several"),
])
def test_bad_client_input_is_one_usage_line(capsys, flags, says):
    with pytest.raises(SystemExit) as done:
        main(["generate", *flags])
    err = capsys.readouterr().err
    assert done.value.code == 2 and says in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("target", ["127.0.0.1:50051", "[::1]:50051", "localhost:1",
                                    "dns:///prefill.internal:50061", "unix:/tmp/x.sock"])
def test_good_targets_pass(target):
    assert generate.parser().parse_args(["--target", target, "x"]).target == target


def test_health_refuses_a_target_without_a_port(capsys):
    with pytest.raises(SystemExit) as done:
        main(["health", "localhost"])
    assert done.value.code == 2 and "is not HOST:PORT" in capsys.readouterr().err


def test_config_show_redacts_the_api_token(capsys, monkeypatch):
    assert main(["config", "show", "decode", "--api-token", "s3cret-flag"]) == 0
    shown = capsys.readouterr().out
    assert "s3cret-flag" not in shown and json.loads(shown)["api_token"] == "<redacted>"
    monkeypatch.setenv("KVHANDOFF_API_TOKEN", "s3cret-env")
    assert main(["config", "show", "decode"]) == 0
    assert "s3cret-env" not in capsys.readouterr().out
    monkeypatch.delenv("KVHANDOFF_API_TOKEN")
    assert main(["config", "show", "decode"]) == 0
    assert json.loads(capsys.readouterr().out)["api_token"] == ""  # unset stays visible


def test_default_ports_agree_with_the_docs_and_each_other(capsys, monkeypatch):
    for var in ("KVHANDOFF_PORT", "KVHANDOFF_PREFILL_TARGET", "KVHANDOFF_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    docs = (REPO / "docs" / "operations.md").read_text()
    words = (r"\*\*decode\*\* \(gRPC `kvhandoff\.v1\.GenerationService`, port (\d+) by default\); "
             r"decode pulls each prompt's KV from \*\*prefill\*\* \(`HandoffService`, port (\d+)\)")
    documented = re.search(words.replace(" ", r"\s+"), docs)
    assert documented, "docs/operations.md no longer states the default ports"
    decode_port, prefill_port = map(int, documented.groups())
    shown = {}
    for role in ("prefill", "decode"):
        assert main(["config", "show", role]) == 0
        shown[role] = json.loads(capsys.readouterr().out)
    assert shown["prefill"]["service"]["port"] == prefill_port
    assert shown["decode"]["service"]["port"] == decode_port
    assert shown["decode"]["prefill_target"] == f"127.0.0.1:{prefill_port}"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv", [["generate", "--token-ids", "1", "--timeout", "2"],
                                  ["health", "--timeout", "2"]])
def test_client_commands_do_not_import_torch(argv):
    """`python -X importtime` lists every module the command imported."""
    command, *rest = argv
    target = f"127.0.0.1:{closed_port()}"
    where = ["--target", target] if command == "generate" else [target]
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvhandoff_cli.main",
                             command, *where, *rest], cwd=REPO, capture_output=True, text=True,
                            timeout=60, check=False)
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "grpc" in imported  # the listing is real
    assert not {name for name in imported if name.split(".")[0] == "torch"}
    assert result.returncode == 1  # nothing listens there: a clean failure, not a crash
    assert "Traceback" not in result.stderr
