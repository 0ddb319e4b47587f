"""Regenerates the Python stubs in common/pb/ from protos/ (the one way they are made).

Usage: python scripts/gen_protos.py [--out DIR]
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"
PACKAGE_PREFIX = "common.pb"
DEFAULT_OUT = REPO / "common" / "pb"


def generate(out_dir: Path) -> list[Path]:
    """Writes the *_pb2*.py files under out_dir/kvhandoff/v1 and returns their paths."""
    protos = sorted(PROTO_ROOT.glob("kvhandoff/**/*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as raw:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={raw}",
            f"--pyi_out={raw}",
            f"--grpc_python_out={raw}",
            *[str(p.relative_to(PROTO_ROOT)) for p in protos],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        written = []
        for src in sorted(Path(raw).rglob("*.py*")):
            rel = src.relative_to(raw)
            text = re.sub(
                r"^from kvhandoff\.(\S+) import", rf"from {PACKAGE_PREFIX}.kvhandoff.\1 import",
                src.read_text(), flags=re.M,
            )
            dst = out_dir / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(text)
            written.append(dst)
    for pkg in [out_dir / "kvhandoff", out_dir / "kvhandoff" / "v1"]:
        init = pkg / "__init__.py"
        if not init.exists():
            init.write_text("")
            written.append(init)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    target = args.out / "kvhandoff"
    if target.exists() and args.out == DEFAULT_OUT:
        shutil.rmtree(target)
    for path in generate(args.out):
        print(path.relative_to(args.out))


if __name__ == "__main__":
    sys.exit(main())
