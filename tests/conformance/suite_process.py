"""Running `kvhandoff conformance ...` as a process against real services and reading its
JUnit XML back: case id -> pass | fail | skip (a failed SHOULD case reads as skip)."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.conformance.broken.process import free_port
from tests.helpers.cluster import REPO, Service

SUITE_TIMEOUT = 600
# the decode under test, for every decode suite run here
DECODE_FLAGS = ["--model", "demo", "--pool-tokens", "1024", "--max-context-tokens", "512",
                "--max-chunk-bytes", "16384"]
# a prefill whose pool (256) is below its window (512), so every prefill case applies
PREFILL_FLAGS = ["--model", "demo", "--pool-tokens", "256", "--max-context-tokens", "512",
                 "--allow-context-beyond-pool"]


def shared_memory_decode_flags(shm_dir: Path) -> list[str]:
    """The decode under test on the SHARED_MEMORY plane of a reference prefill on shm_dir (the
    suite then needs `--shm-dir shm_dir` too)."""
    return ["--data-plane", "shared-memory", "--shm-dir", str(shm_dir)]


@dataclass(frozen=True)
class SuiteRun:
    returncode: int
    outcomes: dict[str, str]
    output: str

    def with_outcome(self, outcome: str) -> set[str]:
        return {case for case, o in self.outcomes.items() if o == outcome}


def _suite_command(role: str, junit: Path, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "kvhandoff_cli.main", "conformance", role, "--junit", str(junit),
            "--quiet", *args]


def read_junit(path: Path) -> dict[str, str]:
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "pass"
        if case.find("failure") is not None:
            outcome = "fail"
        elif case.find("skipped") is not None:
            outcome = "skip"
        outcomes[case.get("name")] = outcome
    return outcomes


def _finish(proc: subprocess.Popen, junit: Path) -> SuiteRun:
    output, _ = proc.communicate(timeout=SUITE_TIMEOUT)
    outcomes = read_junit(junit) if junit.exists() else {}
    return SuiteRun(proc.returncode, outcomes, output)


def run_prefill_suite(target: str, workdir: Path, args: list[str] = ()) -> SuiteRun:
    workdir.mkdir(parents=True, exist_ok=True)
    junit = workdir / "prefill-suite.xml"
    proc = subprocess.Popen(_suite_command("prefill", junit, ["--target", target, *args]),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return _finish(proc, junit)


def run_decode_suite(start_decode: Callable[[list[str]], Service], reference: str,
                     workdir: Path, args: list[str] = ()) -> SuiteRun:
    """Starts the suite (its fake prefill listens first), then the decode under test via
    start_decode(flags) pointed at the fake; returns once the suite has finished."""
    workdir.mkdir(parents=True, exist_ok=True)
    junit = workdir / "decode-suite.xml"
    fake_port = free_port()
    decode_port = free_port()
    while decode_port == fake_port:
        decode_port = free_port()
    proc = subprocess.Popen(_suite_command("decode", junit, [
        "--target", f"127.0.0.1:{decode_port}", "--fake-prefill-listen", f"127.0.0.1:{fake_port}",
        "--reference-prefill", reference, *args]), cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    decode = None
    try:
        decode = start_decode([*DECODE_FLAGS, "--port", str(decode_port),
                               "--prefill", f"127.0.0.1:{fake_port}"])
        return _finish(proc, junit)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if decode is not None:
            decode.stop()
