"""CI lints: `.ci/run` runs ruff, and the tree is clean under the rules pinned in pyproject."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_ci_runs_ruff_before_the_tests():
    script = (REPO / ".ci" / "run").read_text().splitlines()
    commands = [line.strip() for line in script if not line.lstrip().startswith("#")]
    assert "ruff check ." in commands
    assert commands.index("ruff check .") < next(
        i for i, line in enumerate(commands) if line.startswith("python -m pytest"))


def test_the_tree_is_ruff_clean():
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.fail(f"no ruff next to {sys.executable}; install the test extras")
    result = subprocess.run([str(ruff), "check", "--no-cache", "."], cwd=REPO,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
