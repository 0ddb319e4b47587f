"""Whether a --device can be used on this machine, said before any model is loaded.

Without this check `--device cuda` on a CPU-only torch ends, after the model has loaded, in
torch's `AssertionError: Torch not compiled with CUDA enabled` and its traceback. torch is
imported only for a CUDA device: `auto` and `cpu` need no check.
"""

from __future__ import annotations

import re

CUDA = re.compile(r"cuda(?::(\d+))?")


def device_problem(device: str, flag: str = "--device") -> str | None:
    """One line saying why `device` cannot be used here and what to pass instead; None when it
    can."""
    if device in ("auto", "cpu"):
        return None
    match = CUDA.fullmatch(device)
    if match is None:
        return f"{flag} {device!r} is not a device; give auto, cpu, cuda or cuda:N"
    import torch

    if torch.version.cuda is None:
        return (f"{flag} {device}: this torch ({torch.__version__}) was built without CUDA; "
                f"pass {flag} cpu (or auto), or install a CUDA build of torch")
    if not torch.cuda.is_available():
        return (f"{flag} {device}: torch sees no CUDA GPU (check the driver and "
                f"CUDA_VISIBLE_DEVICES); pass {flag} cpu (or auto) to run on the CPU")
    count = torch.cuda.device_count()
    index = int(match.group(1) or 0)
    if index >= count:
        return (f"{flag} {device}: this machine has {count} CUDA device"
                f"{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1}); pick one of them")
    return None
