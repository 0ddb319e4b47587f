"""Where decode's time goes on the NIXL rows of `bench transfer`: the rows of bench.transfer_nixl,
with decode's parts timed around the receiver's own functions (wall seconds, summed over every
handoff of the run, warm-ups included) and the decode process's CPU per thread name (user and
system, from /proc, over the NIXL handoffs and over the bare READs apart).

Parts: "read" (decode_svc.nixl_receiver's _Landing._read: posting the READ, which on UCX's
shared-memory transport is also the copy, plus polling), "post" (NixlAgent.read_pieces alone,
bare READs included), "pass" (check_payload: CRC-32C and finiteness over the pages), "deliver"
(after the verifier: the engine told), "resolve" (a chunk frame's whole resolve: read + pass +
bounds and descriptors), "handoff" (a whole handoff; what is left after resolve and deliver is
frame receipt, the verifier and the wait for prefill's next frame).

    python -m bench.nixl_decode_parts --sizes 1GiB --repeats 3

The timers wrap functions in this process only (a spawned prefill imports them unwrapped).
"""

from __future__ import annotations

import collections
import os
import sys
import time

from bench import transfer_nixl
from decode_svc import nixl_receiver


class Parts:
    """Summed wall seconds and calls per part name."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def wrap(self, name: str, fn, is_async: bool = False):
        if is_async:
            async def timed_async(*args, **kwargs):
                started = time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    self.seconds[name] += time.perf_counter() - started
                    self.calls[name] += 1
            return timed_async

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started
                self.calls[name] += 1
        return timed


def thread_cpu() -> dict[str, tuple[float, float]]:
    """thread id -> (name, user s, system s) of this process's threads, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended between the listing and the read
            continue
        out[tid] = (name, int(fields[11]) / tick, int(fields[12]) / tick)
    return out


def cpu_meter(fn, into: collections.Counter):
    """fn (async) with the CPU each thread spent during it added into[<name> user|sys]."""
    async def metered(*args, **kwargs):
        before = thread_cpu()
        try:
            return await fn(*args, **kwargs)
        finally:
            for tid, (name, user, system) in thread_cpu().items():
                _, user0, system0 = before.get(tid, (name, 0.0, 0.0))
                into[f"{name} user"] += user - user0
                into[f"{name} sys"] += system - system0
    return metered


def main(argv: list[str]) -> int:
    parts = Parts()
    landing, agent = nixl_receiver._Landing, nixl_receiver.NixlAgent
    landing.resolve = parts.wrap("resolve", landing.resolve, True)
    landing._read = parts.wrap("read", landing._read, True)
    landing.deliver = parts.wrap("deliver", landing.deliver)
    nixl_receiver.check_payload = parts.wrap("pass", nixl_receiver.check_payload)
    agent.read_pieces = parts.wrap("post", agent.read_pieces)
    cpu = {"nixl": collections.Counter(), "bare": collections.Counter()}
    transfer_nixl._handoff = parts.wrap("handoff", cpu_meter(transfer_nixl._handoff,
                                                             cpu["nixl"]), True)
    transfer_nixl.bare_read = parts.wrap("bare", cpu_meter(transfer_nixl.bare_read,
                                                           cpu["bare"]), True)
    transfer_nixl.main(argv)
    print(f"{'part':>10} {'seconds':>9} {'calls':>6}")
    for name, seconds in parts.seconds.items():
        print(f"{name:>10} {seconds:>9.3f} {parts.calls[name]:>6}")
    for row, counter in cpu.items():
        spent = ", ".join(f"{k} {v:.2f}" for k, v in counter.most_common() if v >= 0.01)
        print(f"CPU s during {row}: {spent}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
