"""What a new user's mistakes print: one line that names the input and the fix, the exit code,
no Python traceback and no gRPC core log line (`E1201 12:00:00.000 ... file.cc:12] ...`).

Each case runs the real command and fails before any service starts (closed loopback ports,
refusals that come before a model loads), so each takes seconds."""

from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from tests.helpers.cluster import REPO
from tests.helpers.tls import CertificateAuthority

CLI = [sys.executable, "-m", "kvhandoff_cli.main"]
GRPC_CORE_LINE = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d", re.M)


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def one_line(result: subprocess.CompletedProcess, code: int, stream: str = "stderr") -> str:
    """The one line the command printed on stream, after checking the exit code and that
    nothing else (no traceback, no gRPC core log, no blank line) was printed; a service's JSON
    log lines (`{"event": ...}`) are its log, not its message, and are left out."""
    text = getattr(result, stream)
    everything = result.stdout + result.stderr
    assert result.returncode == code, (result.returncode, everything)
    assert "Traceback" not in everything, everything
    assert not GRPC_CORE_LINE.search(everything), everything
    lines = [line for line in text.splitlines() if not _is_log_line(line)]
    assert len(lines) == 1 and lines[0].strip(), everything
    return lines[0]


def _is_log_line(line: str) -> bool:
    try:
        return "event" in json.loads(line)
    except (ValueError, TypeError):
        return False


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ours, theirs = CertificateAuthority.create(root, "ours"), CertificateAuthority.create(
        root, "theirs")
    not_pem = root / "not.pem"
    not_pem.write_text("this is not a certificate\n")
    return {"server": ours.issue("server"), "other_ca": theirs.cert, "not_pem": not_pem}


@pytest.fixture(scope="module")
def tls_server(pki):
    """A TLS health server whose certificate our CA signed (not the other one)."""
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    identity = pki["server"]
    creds = grpc.ssl_server_credentials([(identity.key.read_bytes(),
                                          identity.cert.read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


# 1 and 3: a --tls-ca that is missing, or not PEM
@pytest.mark.parametrize("command", ["generate", "health"])
@pytest.mark.parametrize("which", ["missing", "not_pem"])
def test_a_bad_tls_ca_file_is_one_line(pki, tmp_path, command, which):
    path = str(tmp_path / "nonexistent.pem") if which == "missing" else str(pki["not_pem"])
    target = closed_port()
    args = ["--target", target, "hi"] if command == "generate" else [target]
    line = one_line(run(command, *args, "--tls-ca", path), 2)
    assert line.startswith(f"kvhandoff {command}: error: --tls-ca {path}: "), line
    assert ("no such file" if which == "missing" else "not a PEM certificate") in line, line
    assert "give the PEM file of the CA certificate" in line


# 3: a CA of another authority
def test_a_ca_of_another_authority_is_said_in_words(pki, tls_server):
    ca = str(pki["other_ca"])
    line = one_line(run("generate", "--target", tls_server, "--tls-ca", ca, "hi"), 1)
    assert line == (f"error: UNAVAILABLE: TLS handshake with {tls_server} failed: its "
                    f"certificate is not signed by the CA in --tls-ca {ca}; give the CA that "
                    f"signed the server's certificate"), line
    line = one_line(run("health", tls_server, "--tls-ca", ca), 1, "stdout")
    assert line.startswith(f"{tls_server} (server) TLS_FAILED (server_certificate_not_trusted): "
                           f"TLS handshake"), line


def test_the_right_ca_is_served_and_plaintext_to_tls_is_named(pki, tls_server):
    ok = run("health", tls_server, "--tls-ca", str(pki["server"].ca))
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stdout + ok.stderr
    line = one_line(run("health", tls_server), 1, "stdout")
    assert "if it serves TLS, pass --tls-ca" in line, line


# 2: --device cuda with a torch that cannot use it
@pytest.mark.parametrize("argv", [["prefill", "--device", "cuda:0", "--port", "0"],
                                  ["up", "--device", "cuda", "--port", "0"]])
def test_an_unusable_cuda_device_is_one_line(argv):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    line = one_line(run(*argv), 2)
    assert line.startswith(f"kvhandoff {argv[0]}: refusing to start: --device cuda"), line
    assert "pass --device cpu (or auto)" in line, line


# 5: up refuses before it starts a child, and says it once
@pytest.mark.parametrize("flags, says", [
    (["--port", "70000"], "--port: port must be in [0, 65535], got 70000"),
    (["--page-size", "0"], "--page-size: page_size must be >= 1, got 0"),
    (["--kernels", "foo"], "--kernels: kernels must be one of"),
])
def test_up_refuses_bad_flags_once_before_starting_anything(flags, says):
    line = one_line(run("up", *flags), 2)
    assert line.startswith("kvhandoff up: refusing to start: ") and says in line, line


# 6: --model refusals name the path and what is wrong with it
def test_model_refusals_name_the_input(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{oops")
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"\0")
    cases = {str(tmp_path / "missing"): "no such directory", str(a_file): "a file, not a "
             "directory", str(bad): f"{bad / 'config.json'}: not valid JSON"}
    for model, says in cases.items():
        line = one_line(run("up", "--model", model), 2)
        assert line.startswith("kvhandoff up: refusing to start: ") and says in line, line
    line = one_line(run("prefill", "--model", str(bad), "--port", "0"), 2)
    assert line.startswith("kvhandoff prefill: refusing to start: ") and "not valid JSON" in line


# 6b: a benchmark given a model or a window it cannot use says so in one line
@pytest.mark.parametrize("argv, says", [
    (["decode", "--model", "MISSING", "--batches", "1"], "MISSING: no such directory"),
    (["prefill", "--model", "MISSING"], "MISSING: no such directory"),
    (["serve", "--model", "MISSING", "--num-prompts", "1"], "MISSING: no such directory"),
    (["decode", "--model", "demo", "--batches", "1", "--prompt-len", "5000"],
     "--prompt-len 5000 + --new-tokens 64 = 5064 tokens a sequence: "),
])
def test_a_benchmark_refusal_is_one_line(tmp_path, argv, says):
    missing = str(tmp_path / "missing")
    argv = [missing if a == "MISSING" else a for a in argv]
    says = says.replace("MISSING", missing)
    line = one_line(run("bench", *argv), 2)
    assert line.startswith(f"kvhandoff bench {argv[0]}: ") and says in line, line
    if "--prompt-len" in argv:
        assert "max_position_embeddings 4096" in line, line


# 7: errors start on their own line, and are JSON with --json
def test_generate_errors_are_one_line_and_json_with_json():
    target = closed_port()
    line = one_line(run("generate", "--target", target, "hi"), 1)
    assert line == (f"error: UNAVAILABLE: nothing listens at {target} (connection refused); "
                    f"start the service or fix it"), line
    result = run("generate", "--json", "--target", target, "hi")
    error = json.loads(one_line(result, 1, "stdout"))["error"]
    assert error["code"] == "UNAVAILABLE" and target in error["message"], error
    assert result.stderr == ""


# 8: config --help
def test_config_help_is_help_and_a_missing_subcommand_is_one_line():
    result = run("config", "--help")
    assert result.returncode == 0 and result.stdout.startswith("usage: kvhandoff config show")
    line = one_line(run("config"), 2)
    assert line == "kvhandoff config: no subcommand; kvhandoff config show prefill|decode [flags]"


# 9: conformance --list needs no target
@pytest.mark.parametrize("role, case", [("prefill", "handoff_one_token"),
                                        ("decode", "good_passthrough")])
def test_conformance_list_needs_no_target(role, case):
    result = run("conformance", role, "--list")
    assert result.returncode == 0, result.stderr
    assert case in result.stdout.split()
    line = one_line(run("conformance", role), 2)
    assert "--target" in line and "required to run the suite" in line, line


# 13: help and the flags agree
def test_help_lists_every_benchmark_and_top_p_takes_its_documented_range():
    from bench.cli import BENCHMARKS

    listed = run("--help").stdout
    assert f"bench {'|'.join(BENCHMARKS)}:" in listed, listed
    line = run("generate", "--top-p", "1.5", "hi").stderr.splitlines()[-1]
    assert line == "kvhandoff generate: error: argument --top-p: 1.5 is not a number in [0, 1]"
    from kvhandoff_cli.generate import parser

    assert parser().parse_args(["--top-p", "0", "hi"]).top_p == 0.0  # 0: no cut, as 1


def test_up_help_shows_each_default_once():
    text = run("up", "--help").stdout
    entries = re.split(r"\n  (?=-)", text)
    doubled = [e.split()[0] for e in entries if len(re.findall(r"\(default: ", e)) > 1]
    assert doubled == [] and "(default: None)" not in text, doubled


def test_verbose_is_taken_off_argv_and_keeps_grpc_logging(monkeypatch):
    from kvhandoff_cli.main import quiet_grpc

    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    assert quiet_grpc(["health", "--verbose", "x:1"]) == ["health", "x:1"]
    import os

    assert "GRPC_VERBOSITY" not in os.environ
    assert quiet_grpc(["health", "x:1"]) == ["health", "x:1"]
    assert os.environ["GRPC_VERBOSITY"] == "NONE"


# 14: the ready line names the metrics ports the children logged
def test_the_ready_line_names_the_metrics_urls():
    from kvhandoff_cli.up import _logged_metrics_port, _metrics_line

    class Child:
        def __init__(self, role: str, port: int) -> None:
            self.role, self.metrics_port = role, port

    line = '{"event": "listening", "role": "decode", "metrics_port": 9400}'
    assert _logged_metrics_port(line, -1) == 9400
    assert _logged_metrics_port("not json", 7) == 7
    assert _metrics_line("127.0.0.1", [Child("prefill", 9401), Child("decode", 9400)]) == (
        "metrics http://127.0.0.1:9400/metrics (decode), http://127.0.0.1:9401/metrics "
        "(prefill)")
    assert _metrics_line("127.0.0.1", [Child("prefill", -1), Child("decode", -1)]).startswith(
        "metrics off")


def test_the_tls_ca_check_reads_only_pem(tmp_path: Path):
    from kvhandoff_cli.client_tls import TlsFileError, read_pem

    with pytest.raises(TlsFileError, match="not a file"):
        read_pem(str(tmp_path), "--tls-ca")
    key = tmp_path / "key.pem"
    key.write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(TlsFileError, match="--tls-key .*not a PEM private key"):
        read_pem(str(key), "--tls-key")


# 14: --help of the services, and up's refusals of its flags, load no torch
@pytest.mark.parametrize("argv", [["prefill", "--help"], ["decode", "--help"],
                                  ["up", "--port", "70000"]])
def test_help_and_flag_refusals_do_not_import_torch(argv):
    """`python -X importtime` lists every module the command imported."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvhandoff_cli.main",
                             *argv], cwd=REPO, capture_output=True, text=True, timeout=60,
                            check=False)
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "kvhandoff_cli.settings" in imported or "kvhandoff_cli.up" in imported  # real
    assert not {name for name in imported if name.split(".")[0] == "torch"}


# 11: an empty --api-token (an unset $TOKEN) would run the API without a token: refused
@pytest.mark.parametrize("argv", [["--api-token", ""], ["--api-token="]])
def test_an_empty_api_token_is_refused(argv):
    line = one_line(run("decode", "--port", "0", *argv), 2)
    assert line.startswith("kvhandoff decode: refusing to start: --api-token is empty"), line


# 13: a config file (or the environment) with several problems reports every one at once
def test_every_problem_of_a_config_file_is_reported(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('[service]\nport = "abc"\nbogus = 1\n[prefill]\nalso_bogus = 2\n')
    line = one_line(run("config", "show", "prefill", "--config", str(config)), 2)
    for says in ("port: expected an integer, got str 'abc'", "unknown key 'bogus'",
                 "unknown key 'also_bogus'"):
        assert says in line, line
