"""buf lint and buf breaking (against the committed v1 baseline image) report nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASELINE = REPO / "protos" / "baseline" / "kvhandoff_v1.binpb"


@pytest.fixture(scope="module")
def buf() -> Path:
    path = Path(sys.executable).parent / "buf"
    if not path.exists():
        pytest.fail(f"no buf next to {sys.executable}; install the test extras (buf-bin)")
    return path


def run_buf(buf: Path, cache: Path, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(buf), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"BUF_CACHE_DIR": str(cache), "HOME": str(cache),
                                            "PATH": ""})


def test_lint_is_clean(buf, tmp_path):
    result = run_buf(buf, tmp_path, "lint", "protos")
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_no_breaking_change_against_the_v1_baseline(buf, tmp_path):
    result = run_buf(buf, tmp_path, "breaking", "protos", "--against", str(BASELINE))
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_breaking_check_catches_a_renumbered_field(buf, tmp_path):
    """The baseline check is live: moving a field number in a copy of the protos is reported."""
    copy = tmp_path / "protos"
    shutil.copytree(REPO / "protos", copy, ignore=shutil.ignore_patterns("baseline"))
    handoff = copy / "kvhandoff" / "v1" / "handoff.proto"
    text = handoff.read_text()
    assert "uint32 crc32c = 8;" in text
    handoff.write_text(text.replace("uint32 crc32c = 8;", "uint32 crc32c = 99;"))
    result = run_buf(buf, tmp_path / "cache", "breaking", str(copy), "--against", str(BASELINE))
    assert result.returncode != 0
    assert 'field "8" with name "crc32c"' in result.stdout, result.stdout + result.stderr
