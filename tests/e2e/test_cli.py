"""The operator's path: `kvhandoff up` prints ready, `kvhandoff generate` streams and fails
loudly, SIGTERM stops both services."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from common.handoff.nixl_agent import nixl_available
from common.handoff.planes import DEFAULT_SHM_DIR, host_identity
from tests.helpers.cluster import REPO

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "kvhandoff_cli.main"]


def _wait_ready(proc: subprocess.Popen, timeout: float = 180.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "ready" in line:
            return line
        assert proc.poll() is None, "kvhandoff up exited before ready"
    raise AssertionError("no ready line")


def test_up_generate_and_stop():
    up = subprocess.Popen([*CLI, "up", "--port", "0", "--prefill-pool-tokens", "8192",
                           "--decode-pool-tokens", "8192"], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
    try:
        line = _wait_ready(up)
        address = re.search(r"serving at (\S+)", line).group(1)
        assert "max prompt 4096 tokens" in line and "8192 tokens" in line
        usable = host_identity(DEFAULT_SHM_DIR)  # both sides offer shm on one host with /dev/shm
        plane = ("shared-memory" if usable  # planes.PREFERENCE: shm, then NIXL
                 else "nixl" if nixl_available()[0] else "inline")
        assert f"data plane {plane}" in line
        ok = subprocess.run([*CLI, "generate", "--target", address, "--token-ids", "3,4,5",
                             "--max-tokens", "5", "--json", "--ignore-eos"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0, ok.stderr
        lines = [json.loads(x) for x in ok.stdout.splitlines() if x.strip()]
        assert len(lines[-1]["token_ids"]) == 5
        assert lines[-1]["finish_reason"] == "length"
        assert [x["token_id"] for x in lines[:-1]] == lines[-1]["token_ids"]
        text = subprocess.run([*CLI, "generate", "--target", address, "Hello", "--max-tokens",
                               "4"], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert text.returncode == 0 and text.stdout.strip()
        bad = subprocess.run([*CLI, "generate", "--target", address, "--token-ids", "3,99999"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0
        assert "INVALID_ARGUMENT" in bad.stderr and "99999" in bad.stderr
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0


def test_help_lists_every_command():
    out = subprocess.run([*CLI, "--help"], cwd=REPO, capture_output=True, text=True).stdout
    for command in ("up", "prefill", "decode", "generate", "config", "conformance", "bench"):
        assert re.search(rf"^\s+{command}\s", out, re.M), command
