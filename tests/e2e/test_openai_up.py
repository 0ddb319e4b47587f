"""`kvhandoff up --http-port 0`: the ready line names the OpenAI-compatible API, the `openai`
client talks to it as it is, and SIGTERM still stops both services cleanly."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import openai
import pytest

from tests.helpers.cluster import REPO

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "kvhandoff_cli.main"]


def _wait_ready(proc: subprocess.Popen, timeout: float = 180.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("ready"):
            return line
        assert proc.poll() is None, "kvhandoff up exited before ready"
    raise AssertionError("no ready line")


def test_up_serves_the_openai_api_on_its_http_port():
    up = subprocess.Popen([*CLI, "up", "--port", "0", "--http-port", "0", "--pool-tokens",
                           "4096"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True)
    try:
        line = _wait_ready(up)
        base = re.search(r"OpenAI-compatible API at (http://127\.0\.0\.1:\d+/v1)", line).group(1)
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["demo"]
        done = client.completions.create(model="demo", prompt="Hello", max_tokens=4,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 4 and done.choices[0].finish_reason == "length"
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
