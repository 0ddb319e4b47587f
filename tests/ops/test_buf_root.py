"""A bare `buf lint` / `buf breaking` at the repository root checks protos/ and nothing else.

Without the root buf.yaml, buf takes the root as one module and lints every .proto under it,
the googleapis copies in .venv included. The tests run on a copy of the root holding such a
stray file, so they do not depend on where the venv lives.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASELINE = "protos/baseline/kvhandoff_v1.binpb"


@pytest.fixture
def root(tmp_path) -> Path:
    """A copy of the repository root's buf inputs plus a stray, broken .proto in .venv/."""
    copy = tmp_path / "repo"
    copy.mkdir()
    if (REPO / "buf.yaml").exists():
        shutil.copy(REPO / "buf.yaml", copy / "buf.yaml")
    shutil.copytree(REPO / "protos", copy / "protos")
    stray = copy / ".venv" / "lib" / "google" / "api" / "stray.proto"
    stray.parent.mkdir(parents=True)
    stray.write_text('syntax = "proto3";\nimport "google/api/missing.proto";\nmessage x {}\n')
    return copy


def run_buf(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    buf = Path(sys.executable).parent / "buf"
    if not buf.exists():
        pytest.fail(f"no buf next to {sys.executable}; install the test extras (buf-bin)")
    cache = cwd.parent / "cache"
    return subprocess.run([str(buf), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False,
                          env={"BUF_CACHE_DIR": str(cache), "HOME": str(cache), "PATH": ""})


def test_bare_lint_and_breaking_at_the_root_check_only_protos(root):
    lint = run_buf(root, "lint")
    assert lint.returncode == 0 and not lint.stdout.strip(), lint.stdout + lint.stderr
    breaking = run_buf(root, "breaking", "--against", BASELINE)
    assert breaking.returncode == 0, breaking.stdout + breaking.stderr


def test_bare_lint_at_the_root_still_sees_the_protocol(root):
    """The root config is no way of linting nothing: a lint error in protos/ is reported."""
    common = root / "protos" / "kvhandoff" / "v1" / "common.proto"
    text = common.read_text()
    common.write_text(text + "\nmessage bad_name {}\n")
    lint = run_buf(root, "lint")
    assert lint.returncode != 0
    assert "bad_name" in lint.stdout and "stray.proto" not in lint.stdout, lint.stdout
