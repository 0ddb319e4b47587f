"""Configuration: TOML file < environment < flags, checked at start with clear errors (exit 2),
and `kvhandoff config show ROLE` printing the effective result."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvhandoff_cli.main import main
from tests.helpers.cluster import REPO

FILE = """
[service]
page_size = 8
pool_tokens = 1024
grace_seconds = 7

[prefill]
max_batch_tokens = 512

[decode]
max_batch = 3
prefill_target = "prefill.internal:50061"
"""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Each test sees no KVHANDOFF_* variable but the ones it sets."""
    for name in [n for n in os.environ if n.startswith("KVHANDOFF_")]:
        monkeypatch.delenv(name)


def show(capsys, *argv: str) -> dict:
    assert main(["config", "show", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def refused(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["config", "show", *argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_defaults(capsys):
    config = show(capsys, "prefill")
    assert config["service"]["page_size"] == 16 and config["max_batch_tokens"] == 2048
    assert show(capsys, "decode")["max_batch"] == 64


def test_flags_beat_environment_beat_file(capsys, tmp_path, monkeypatch):
    path = tmp_path / "kvhandoff.toml"
    path.write_text(FILE)
    monkeypatch.setenv("KVHANDOFF_PAGE_SIZE", "32")
    monkeypatch.setenv("KVHANDOFF_MAX_BATCH", "5")
    monkeypatch.setenv("KVHANDOFF_MAX_BATCH_TOKENS", "")  # empty: unset, the file's value holds
    config = show(capsys, "decode", "--config", str(path), "--page-size", "64")
    assert config["service"]["page_size"] == 64  # flag over env over file
    assert config["max_batch"] == 5  # env over file
    assert config["service"]["pool_tokens"] == 1024  # file over default
    assert config["service"]["grace_seconds"] == 7.0  # an int in TOML is fine for a float
    assert config["prefill_target"] == "prefill.internal:50061"
    assert show(capsys, "decode", "--config", str(path), "--prefill", "p:1")[
        "prefill_target"] == "p:1"
    prefill = show(capsys, "prefill", "--config", str(path))
    assert prefill["max_batch_tokens"] == 512 and prefill["service"]["page_size"] == 32


def test_config_file_from_the_environment(capsys, tmp_path, monkeypatch):
    path = tmp_path / "kvhandoff.toml"
    path.write_text(FILE)
    monkeypatch.setenv("KVHANDOFF_CONFIG", str(path))
    assert show(capsys, "prefill")["service"]["pool_tokens"] == 1024


def test_booleans_from_environment_and_flags(capsys, monkeypatch):
    monkeypatch.setenv("KVHANDOFF_POISON_FREED_PAGES", "yes")
    assert show(capsys, "prefill")["service"]["poison_freed_pages"] is True
    config = show(capsys, "prefill", "--no-poison-freed-pages")
    assert config["service"]["poison_freed_pages"] is False


@pytest.mark.parametrize("env, argv, file_text, message", [
    ({"KVHANDOFF_PAGE_SIZE": "abc"}, [], None, "KVHANDOFF_PAGE_SIZE='abc': expected an integer"),
    ({"KVHANDOFF_SCRUB_FREED_PAGES": "maybe"}, [], None, "expected true or false"),
    ({"KVHANDOFF_MEMORY_FRACTION": "1.5"}, [], None,
     "$KVHANDOFF_MEMORY_FRACTION: memory_fraction must be in [0, 1], got 1.5"),
    ({}, ["--page-size", "0"], None, "--page-size: page_size must be >= 1, got 0"),
    ({}, ["--port", "70000"], None, "port must be in [0, 65535]"),
    ({}, ["--dtype", "fp8"], None, "dtype must be one of auto, float32, float16, bfloat16"),
    ({}, ["--device", "gpu"], None, "device must be auto, cpu, cuda or cuda:N"),
    ({}, ["--tls-key", "k.pem"], None, "tls_key is set but tls_cert is not"),
    ({}, ["--page-size", "x"], None, "invalid int value: 'x'"),
    ({}, [], "[service]\npagesize = 8\n", "unknown key 'pagesize'"),
    ({}, [], "[decode]\nmax_batchh = 8\n", "[decode]: unknown key 'max_batchh'"),
    ({}, [], "[service]\npage_size = \"16\"\n", "page_size: expected an integer, got str '16'"),
    ({}, [], "[service]\nscrub_freed_pages = 1\n", "expected true or false, got int 1"),
    ({}, [], "page_size = 8\n", "unknown key 'page_size'; settings go under [service]"),
    ({}, [], "[server]\nport = 1\n", "unknown table 'server'"),
    ({}, [], "[service\n", "invalid TOML"),
    ({}, [], "[service]\npool_tokens = -1\n", "[service] pool_tokens: pool_tokens must be >= 0"),
])
def test_bad_settings_exit_2_with_a_clear_error(capsys, tmp_path, monkeypatch, env, argv,
                                                 file_text, message):
    for name, text in env.items():
        monkeypatch.setenv(name, text)
    if file_text is not None:
        (tmp_path / "c.toml").write_text(file_text)
        argv = [*argv, "--config", str(tmp_path / "c.toml")]
    err = refused(capsys, "prefill", *argv)
    assert message in err, err


def test_missing_config_file(capsys, tmp_path):
    err = refused(capsys, "decode", "--config", str(tmp_path / "absent.toml"))
    assert "absent.toml" in err and "No such file" in err


def test_every_error_is_listed_at_once(capsys):
    err = refused(capsys, "decode", "--page-size", "0", "--max-batch", "0")
    assert "page_size must be >= 1" in err and "max_batch must be >= 1" in err


@pytest.mark.slow
def test_services_refuse_bad_settings_before_loading_anything(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "KVHANDOFF_PAGE_SIZE": "0"}
    result = subprocess.run([sys.executable, "-m", "kvhandoff_cli.main", "prefill"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "kvhandoff prefill: error: $KVHANDOFF_PAGE_SIZE: page_size must be >= 1" in \
        result.stderr
    assert "runtime_ready" not in result.stderr + result.stdout
