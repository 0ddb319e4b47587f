"""What `kvhandoff up` refuses before it starts a child: each refusal is then said once, by up,
in one line, and nothing is loaded first (a decode --port of 70000 used to be found after
prefill had loaded its model, then printed twice: the child's line and up's copy of it).

The ranges and choices are the services' own (`kvhandoff_cli.settings.check_values`), the
device check is `device_check`, and a --model directory is read as the loader reads it
(`common.model.loader.checkpoint_config`), so up and the services refuse the same things.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# up's flags that reach both services unchanged: setting name -> up's flag
SHARED = {"page_size": "--page-size", "kernels": "--kernels", "device": "--device",
          "dtype": "--dtype", "max_context_tokens": "--max-context-tokens",
          "memory_fraction": "--memory-fraction", "kv_cache_bytes": "--kv-cache-bytes",
          "model": "--model"}
PORTS = {"port": "--port", "prefill_port": "--prefill-port", "metrics_port": "--metrics-port"}


def refusal(args: argparse.Namespace) -> str | None:
    """Why up cannot start with these flags (every range and choice problem at once, then the
    device, then the model), or None."""
    from kvhandoff_cli.settings import SettingsError, check_values

    checks = [({"metrics_port" if name == "metrics_port" else "port": getattr(args, name)},
               {"metrics_port" if name == "metrics_port" else "port": flag})
              for name, flag in PORTS.items()]  # each against the services' port range
    checks.append(({name: getattr(args, name) for name in SHARED}, SHARED))
    problems = []
    for values, flags in checks:
        try:
            check_values(values, flags)
        except SettingsError as err:
            problems.append(str(err))
    if problems:
        return "; ".join(problems)
    from kvhandoff_cli.device_check import device_problem

    if problem := device_problem(args.device):
        return problem
    if args.model != "demo":
        from common.model.config import UnsupportedModelError
        from common.model.loader import checkpoint_config

        try:
            checkpoint_config(Path(args.model))
        except (FileNotFoundError, UnsupportedModelError) as err:
            return str(err)
    return None
