"""glibc malloc settings for processes that move KV handoffs.

Every handoff frame is a fresh multi-MiB `bytes` (gRPC hands decode each message as one, and
prefill's frame is joined into one). With glibc's defaults such a block is mmapped, or carved
from a heap that is trimmed back to the kernel when freed, so each frame's memory is
page-faulted in anew: measured here, that first touch costs more than the copy itself.
`keep_freed_heap` serves blocks up to `mmap_threshold` from the heap and keeps up to
`trim_threshold` of freed memory mapped, so frames reuse warm pages. The environment variables
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ do the same before a process starts (compose
and k8s set them; docs/operations.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
DEFAULT_MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit hosts
DEFAULT_TRIM_THRESHOLD = 1 << 30


def keep_freed_heap(mmap_threshold: int = DEFAULT_MMAP_THRESHOLD,
                    trim_threshold: int = DEFAULT_TRIM_THRESHOLD) -> bool:
    """Applies both settings to this process; False where the C library is not glibc (nothing
    changed, everything still works, only slower)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(M_TRIM_THRESHOLD, trim_threshold))
