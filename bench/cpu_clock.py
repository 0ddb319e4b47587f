"""CPU seconds a process has used so far (user plus system, all its threads), for the
`bench transfer` rows: on a host with fewer cores than busy threads a transport's rate is set by
the CPU its two processes spend per byte, so each row also reports CPU seconds per GB. Both
readings count in clock ticks (10 ms here): meaningful for runs of a few hundred ms and more
(256 MiB and up on this host), not for small sizes."""

from __future__ import annotations

import os
from pathlib import Path


def process_cpu_seconds(pid: int | None = None) -> float:
    """This process (pid None) or another one on this host, from /proc/<pid>/stat."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


class CpuMeter:
    """cpu() -> (decode's, prefill's) CPU seconds so far; decode is this process."""

    def __init__(self, prefill_pid: int) -> None:
        self.prefill_pid = prefill_pid

    def cpu(self) -> tuple[float, float]:
        return process_cpu_seconds(), process_cpu_seconds(self.prefill_pid)

    def since(self, before: tuple[float, float]) -> tuple[float, float]:
        """(decode, prefill) CPU seconds used since the reading `before`."""
        now = self.cpu()
        return now[0] - before[0], now[1] - before[1]
