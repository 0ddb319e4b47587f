"""The committed stubs in common/pb are exactly what scripts/gen_protos.py makes from protos/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_current(tmp_path):
    script = REPO / "scripts" / "gen_protos.py"
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*.py*")}
    committed_root = REPO / "common" / "pb"
    committed = {p.relative_to(committed_root): p.read_bytes()
                 for p in (committed_root / "kvhandoff").rglob("*.py*")}
    assert fresh.keys() == committed.keys(), "stub files differ; run scripts/gen_protos.py"
    stale = [str(k) for k in fresh if fresh[k] != committed[k]]
    assert not stale, f"stale stubs {stale}; run scripts/gen_protos.py"
