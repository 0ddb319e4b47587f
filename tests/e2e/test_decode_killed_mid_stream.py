"""A decode that dies mid-stream: `kvhandoff generate` says the connection was lost, after how
many tokens, and what to do (reason CONNECTION_LOST), not gRPC's bare "Socket closed"; no
traceback. The kill lands after tokens were read, so the count is never zero."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from tests.helpers.cluster import REPO, start_cluster

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "kvhandoff_cli.main"]


def test_a_killed_decode_is_said_as_a_lost_connection(tmp_path):
    cluster = start_cluster(tmp_path, "demo", common_flags=["--pool-tokens", "8192"])
    client = None
    try:
        client = subprocess.Popen(
            [*CLI, "generate", "--target", cluster.address, "--json", "--ignore-eos",
             "--max-tokens", "4000", "Once upon a time"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(3):  # three tokens streamed: the call is mid-stream
            assert "token_id" in client.stdout.readline()
        cluster.decode.proc.send_signal(signal.SIGKILL)
        rest, errors = client.communicate(timeout=60)
    finally:
        if client is not None and client.poll() is None:
            client.kill()
        cluster.stop()
    assert client.returncode == 1 and "Traceback" not in errors, errors
    error = json.loads(rest.strip().splitlines()[-1])["error"]
    assert error["code"] == "UNAVAILABLE" and error["reason"] == "CONNECTION_LOST", error
    assert error["message"].startswith(f"the connection to {cluster.address} was lost after ")
    tokens = int(error["message"].split(" was lost after ")[1].split()[0])
    assert tokens >= 3 and "the text above is incomplete" in error["message"], error
