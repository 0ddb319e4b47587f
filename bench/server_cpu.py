"""CPU seconds that a server's processes have used so far, its child processes included (vLLM's
API server forks its engine core; our services are one process each), read from /proc, for
the CPU-seconds-per-output-token column of `kvhandoff bench serve`."""

from __future__ import annotations

from pathlib import Path

from bench.cpu_clock import process_cpu_seconds


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process on this host now."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited while we looked
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    return parents


def process_tree(pids: list[int]) -> list[int]:
    """The given pids and every live descendant of theirs."""
    parents = _parents()
    found, frontier = set(pids), list(pids)
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in found]
        found.update(children)
        frontier.extend(children)
    return sorted(found)


def tree_cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU seconds of the pids and their live descendants (a process that
    exits between two readings takes its seconds with it)."""
    total = 0.0
    for pid in process_tree(pids):
        try:
            total += process_cpu_seconds(pid)
        except OSError:
            continue
    return total


def check_pids(pids: list[int]) -> None:
    """Raises ValueError naming a pid that is not a live process here."""
    for pid in pids:
        if not Path(f"/proc/{pid}/stat").exists():
            raise ValueError(f"--server-pids: no process {pid} on this host")
