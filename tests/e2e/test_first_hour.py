"""The first hour with kvhandoff, as a new user meets it: taken ports are refused by number,
`kvhandoff up` says which child failed and takes the flags its refusals name, --metrics-port
gives each service its own port, Ctrl-C in a stream is a clean exit that the server logs and
counts, and the client's messages say what is wrong."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.cluster import REPO
from tests.helpers.polling import wait_until

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "kvhandoff_cli.main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def held_port() -> socket.socket:
    """A port held by a program that is not kvhandoff (and not gRPC)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def run(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


def assert_refused(result: subprocess.CompletedProcess, *says: str) -> None:
    err = result.stderr
    assert result.returncode == 2, (result.returncode, err)
    for text in says:
        assert text in err, err
    assert "Traceback" not in err and "runtime_ready" not in err, err  # before the model loads


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_service_refuses_a_taken_port_by_number(role):
    with held_port() as sock:
        port = sock.getsockname()[1]
        assert_refused(run(role, "--port", str(port)),
                       f"kvhandoff {role}: refusing to start: port {port} on 127.0.0.1 (--port)"
                       " is already in use")
        assert_refused(run(role, "--port", "0", "--metrics-port", str(port)),
                       f"port {port} on 127.0.0.1 (--metrics-port) is already in use")


def test_a_second_prefill_on_the_port_of_a_first_is_refused(tmp_path):
    port_file = tmp_path / "port"
    first = subprocess.Popen([*CLI, "prefill", "--port", "0", "--pool-tokens", "4096",
                              "--port-file", str(port_file)], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: port_file.exists() and port_file.read_text().strip(), timeout=180,
                   what="the first prefill's port file")
        port = int(port_file.read_text())
        assert_refused(run("prefill", "--port", str(port), "--pool-tokens", "4096"),
                       f"port {port} on 127.0.0.1 (--port) is already in use")
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=60)


def test_up_refuses_a_taken_port():
    with held_port() as sock:
        port = sock.getsockname()[1]
        result = run("up", "--port", str(port))
    assert result.returncode == 2, result.stderr
    assert f"kvhandoff up: refusing to start: port {port} on 127.0.0.1 (--port)" in result.stderr
    assert "Traceback" not in result.stderr


def test_up_says_which_child_failed_and_why():
    """The demo's window (4096) does not fit a 1024-token pool: prefill refuses to start."""
    result = run("up", "--port", "0", "--pool-tokens", "1024", timeout=300)
    err = result.stderr
    assert result.returncode == 1, err
    line = next(x for x in err.splitlines() if x.startswith("kvhandoff up:"))
    assert line.startswith("kvhandoff up: prefill exited with status 2 before serving: "
                           "kvhandoff prefill: refusing to start: the KV pool holds 1024 tokens")
    assert "--allow-context-beyond-pool" in line
    assert "Traceback" not in err


class Up:
    """A running `kvhandoff up`, its ready line, and its stderr (the children's logs)."""

    def __init__(self, tmp_path: Path, *flags: str, env: dict | None = None) -> None:
        self.err_path = tmp_path / "up.err"
        self.proc = subprocess.Popen([*CLI, "up", "--port", "0", *flags], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=self.err_path.open("w"),
                                     text=True)
        deadline = time.monotonic() + 300
        self.ready = ""
        while time.monotonic() < deadline and not self.ready:
            line = self.proc.stdout.readline()
            if line.startswith("ready"):
                self.ready = line
            assert line or self.proc.poll() is None, self.err_path.read_text()[-3000:]
        assert self.ready, "no ready line"
        self.address = re.search(r"serving at (\S+)", self.ready).group(1)
        self.prefill = re.search(r"prefill at (\S+?)\)", self.ready).group(1)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=60) == 0


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def cancelled_count(port: int) -> float:
    pattern = r'kvhandoff_requests_finished_total\{[^}]*finished_reason="cancelled"[^}]*\} (\S+)'
    match = re.search(pattern, scrape(port))
    return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module")
def small_up(tmp_path_factory):
    """up with a pool smaller than the window, which needs --allow-context-beyond-pool, and
    --metrics-port: the flags a new user is told to pass."""
    port = free_port()
    while port + 1 > 65535 or not _free(port + 1):
        port = free_port()
    cluster = Up(tmp_path_factory.mktemp("up"), "--pool-tokens", "1024",
                 "--allow-context-beyond-pool", "--metrics-port", str(port))
    cluster.metrics_port = port
    yield cluster
    cluster.stop()


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_up_takes_the_flag_its_refusal_names(small_up):
    assert "max prompt 1024 tokens" in small_up.ready


def test_the_ready_line_explains_the_demo_model(small_up):
    assert "random weights, so its text is noise by design" in small_up.ready
    assert "98 ids" in small_up.ready and "--model DIR" in small_up.ready


def test_up_metrics_port_gives_each_service_its_own(small_up):
    decode, prefill = scrape(small_up.metrics_port), scrape(small_up.metrics_port + 1)
    assert 'role="decode"' in decode and 'role="prefill"' not in decode
    assert 'role="prefill"' in prefill and 'role="decode"' not in prefill


def test_ctrl_c_in_a_stream_is_a_clean_exit_the_server_counts(small_up):
    before = cancelled_count(small_up.metrics_port)
    proc = subprocess.Popen([*CLI, "generate", "--target", small_up.address, "--token-ids",
                             "40,41,42", "--max-tokens", "1000", "--ignore-eos", "--json"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith('{"token_id"')  # streaming has begun
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "cancelled" in err and "Traceback" not in err and "KeyboardInterrupt" not in err
    wait_until(lambda: cancelled_count(small_up.metrics_port) == before + 1, timeout=30,
               what="decode to count the cancelled request")
    assert '"event": "request_cancelled"' in small_up.err_path.read_text()


def test_a_prefill_target_is_named_as_such(small_up):
    result = run("generate", "--target", small_up.prefill, "hello")
    assert result.returncode == 1
    assert f"{small_up.prefill} is a kvhandoff prefill" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_an_empty_text_prompt_is_empty_prompt(small_up):
    result = run("generate", "--target", small_up.address, "")
    assert result.returncode == 1
    assert "INVALID_ARGUMENT" in result.stderr and "EMPTY_PROMPT" in result.stderr


def test_the_documented_metrics_variable_gives_distinct_ports(tmp_path):
    """KVHANDOFF_METRICS_PORT used to reach both children, so decode crashed on prefill's port."""
    port = free_port()
    while not _free(port + 1):
        port = free_port()
    env = {**os.environ, "KVHANDOFF_METRICS_PORT": str(port)}
    cluster = Up(tmp_path, "--pool-tokens", "4096", env=env)
    try:
        assert 'role="decode"' in scrape(port) and 'role="prefill"' in scrape(port + 1)
    finally:
        cluster.stop()
