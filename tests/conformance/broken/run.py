"""`python -m tests.conformance.broken.run VARIANT prefill|decode ARGS...`: applies one broken
variant, then runs the normal CLI entry (`kvhandoff prefill|decode ARGS...`)."""

from __future__ import annotations

import sys

from tests.conformance.broken.variants import VARIANTS, apply


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in VARIANTS or argv[1] not in ("prefill", "decode"):
        print(f"usage: python -m tests.conformance.broken.run VARIANT prefill|decode ARGS...\n"
              f"variants: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    apply(argv[0], argv[1])
    from kvhandoff_cli.main import main as cli_main

    return cli_main([argv[1], *argv[2:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
