"""`kvhandoff up` splits the CPUs it was given between prefill and decode, says so in its ready
line, and the children really run there: their affinity is read from /proc/PID/status and their
torch threads from their cpu_placement log line."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.server.cpu_placement import allowed_cpus, format_cpu_list, parse_cpu_list, split_cores
from tests.helpers.cluster import REPO

pytestmark = pytest.mark.slow


def _children(pid: int) -> dict[str, int]:
    """role -> pid of up's service processes."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for role in ("prefill", "decode"):
            if role.encode() in argv:
                found[role] = int(stat.parent.name)
    return found


def _allowed_list(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(line.split()[1] for line in status.splitlines()
                if line.startswith("Cpus_allowed_list:"))


def test_up_gives_each_service_its_share_of_the_cores(tmp_path):
    if len(allowed_cpus()) < 2:
        pytest.skip("one CPU: both services share it, there is nothing to split")
    prefill_cpus, decode_cpus = (format_cpu_list(c) for c in split_cores(allowed_cpus()))
    err_path = tmp_path / "up.err"
    proc = subprocess.Popen([sys.executable, "-m", "kvhandoff_cli.main", "up", "--port", "0",
                             "--pool-tokens", "1024", "--max-context-tokens", "512"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=err_path.open("w"), text=True)
    try:
        deadline, ready = time.monotonic() + 300, ""
        while time.monotonic() < deadline and not ready:
            line = proc.stdout.readline()
            ready = line if line.startswith("ready") else ""
            assert line or proc.poll() is None, err_path.read_text()[-3000:]
        shares = {"prefill": prefill_cpus, "decode": decode_cpus}
        for role, cpus in shares.items():
            threads = len(parse_cpu_list(cpus))
            assert f"{role} CPUs {cpus}, {threads} torch threads" in ready
        children = _children(proc.pid)
        assert sorted(children) == ["decode", "prefill"]
        for role, pid in children.items():
            assert _allowed_list(pid) == shares[role]
        placed = {}
        for line in err_path.read_text().splitlines():
            if '"cpu_placement"' in line:
                event = json.loads(line)
                placed[event["service"]] = (event["cpus"], event["torch_threads"])
        assert placed == {role: (cpus, len(parse_cpu_list(cpus))) for role, cpus in shares.items()}
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0

