"""The ground floor does not reach up: nothing under common/ imports the packages built on it."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ABOVE_COMMON = ("prefill_svc", "decode_svc", "bench", "conformance", "kvhandoff_cli")


def imported_modules(path: Path) -> list[str]:
    """Every module an `import` or `from ... import` in the file names, lazy ones included."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_common_imports_nothing_above_it():
    files = sorted((REPO / "common").rglob("*.py"))
    assert len(files) > 20  # the scan really saw the tree
    upward = [f"{path.relative_to(REPO)}: {name}" for path in files
              for name in imported_modules(path) if name.split(".")[0] in ABOVE_COMMON]
    assert upward == []


def test_the_scan_sees_lazy_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from prefill_svc.server import serve\n    import bench.cli\n")
    assert imported_modules(sample) == ["prefill_svc.server", "bench.cli"]
