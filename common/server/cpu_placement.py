"""Where a service's compute runs on the CPU: its cores (`--cpu-affinity`) and torch's intra-op
threads (`--torch-threads`), and how `kvhandoff up` splits the cores it was given between
prefill and decode. On a host with few cores, two services that each start one torch thread per
core make every parallel op wait for a timeslice; a split gives each its own cores.

Lists use the kernel's cpulist syntax (`0-3,6`, as in /proc/PID/status Cpus_allowed_list)."""

from __future__ import annotations

import os
from pathlib import Path


class CpuListError(ValueError):
    """A CPU list that cannot be used; the message says what to change."""


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6); raises CpuListError on anything else or an empty list."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()) or (sep and int(high) < int(low)):
            raise CpuListError(f"CPU list {text!r}: use numbers and ranges like 0-3,6")
        cpus.update(range(int(low), int(high if sep else low) + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: tuple[int, ...] | list[int] | set[int]) -> str:
    """(0, 1, 2, 3, 6) -> '0-3,6'."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on."""
    return tuple(sorted(os.sched_getaffinity(0)))


def check_cpu_affinity(text: str) -> tuple[int, ...]:
    """The parsed list, refused (CpuListError) unless every CPU in it is one this process may
    use."""
    cpus = parse_cpu_list(text)
    allowed = allowed_cpus()
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        raise CpuListError(f"CPUs {format_cpu_list(outside)} are not among this process's CPUs "
                           f"({format_cpu_list(allowed)})")
    return cpus


def split_cores(cpus: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prefill's, decode's) cores: the lower half to prefill, the rest to decode (decode gets
    the odd one: it runs every step and also recomputes part of each handoff); with a single
    core both share it."""
    if len(cpus) < 2:
        return tuple(cpus), tuple(cpus)
    half = len(cpus) // 2
    return tuple(cpus[:half]), tuple(cpus[half:])


def borrowable_cpus(cpu_affinity: str, borrow_cpus: str) -> tuple[int, ...]:
    """The CPUs of borrow_cpus that are not already the service's own (cpu_affinity)."""
    if not borrow_cpus:
        return ()
    own = set(check_cpu_affinity(cpu_affinity)) if cpu_affinity else set()
    return tuple(c for c in check_cpu_affinity(borrow_cpus) if c not in own)


def apply_cpu_placement(torch_threads: int, cpu_affinity: str,
                        borrow_cpus: str = "") -> tuple[int, tuple[int, ...]]:
    """Pins every thread of this process to cpu_affinity plus borrow_cpus (empty: left as it
    is) and sets torch's intra-op threads to torch_threads (0: one per CPU of the affinity when
    one is given, else torch's default); the borrowed CPUs add no thread here (the engine adds
    them while its peer idles: common/server/core_borrowing.py). Call before the model runs, so
    that the threads torch starts later inherit the mask. Returns (torch threads, CPUs) now in
    force."""
    import torch

    if cpu_affinity:
        own = check_cpu_affinity(cpu_affinity)
        cpus = tuple(sorted(set(own) | set(borrowable_cpus(cpu_affinity, borrow_cpus))))
        for task in Path("/proc/self/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except ProcessLookupError:  # the thread ended meanwhile
                continue
        torch_threads = torch_threads or len(own)
    if torch_threads > 0:
        torch.set_num_threads(torch_threads)
    return torch.get_num_threads(), allowed_cpus()
