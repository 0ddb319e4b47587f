"""torch's intra-op threads belong to the engine thread alone.

With OpenMP (torch's CPU wheels use GNU's libgomp) every thread that runs a parallel torch op
gets a team of worker threads of its own, and the workers stay parked after it until that
thread ends. libgomp counts every such worker: once a process holds more of them than it has
CPUs, it stops spinning between parallel regions and puts workers to sleep, so each of the
hundreds of parallel regions of a decode step pays a wake-up. A service that loaded its weights
on the main thread and warmed up on an executor thread with N torch threads, then computed on
its engine thread, held three teams of N. Measured on this project's 2-CPU host (bench
checkpoint, bf16, 2 torch threads, decode steps at batch 1 / 8, `kvhandoff bench decode`):
10.7 / 17.1 ms with the loading thread's team beside the engine's, 3.96 / 6.31 ms with the
engine's alone (one thread: 5.87 / 9.36).

So start-up (weights, warm-up) runs with the service's threads on a thread that ends when it
is done (`in_passing_thread`), taking its team with it; the main thread, whose event loop only
runs small ops, computes on one thread (`keep_one_thread`); and the engine thread takes its
threads when it starts (`take_team`). A thread's team size is its own (OpenMP's per-thread
setting), read from torch's process-wide count the first time that thread runs a parallel op,
which is why each call below settles the calling thread at once.

Invariants: the calling thread computes on one thread after `keep_one_thread` and on n after
`take_team(n)`, whatever other threads set later; none of this changes a value (threads change
speed, never results).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def in_passing_thread(fn: Callable[..., T], *args) -> T:
    """fn(*args) on a new thread that ends when fn returns (its torch team ends with it);
    returns fn's result or raises its exception, in the caller's thread."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:  # re-raised in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="torch-start-up", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


async def in_passing_thread_async(fn: Callable[..., T], *args) -> T:
    """in_passing_thread without blocking the event loop meanwhile."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(key: str, value) -> None:
        if not done.done():
            (done.set_exception if key == "error" else done.set_result)(value)

    def run() -> None:
        try:
            value = fn(*args)
        except BaseException as exc:
            loop.call_soon_threadsafe(settle, "error", exc)
        else:
            loop.call_soon_threadsafe(settle, "value", value)

    threading.Thread(target=run, name="torch-start-up", daemon=True).start()
    return await done


def _run_parallel_op() -> None:
    """One op large enough for torch to run in parallel: the calling thread's thread count is
    read (torch's first-use setting) and its team made at that count."""
    a = torch.ones(256, 256)
    _ = a @ a


def keep_one_thread() -> None:
    """The calling thread computes on one torch thread from now on (it makes no team)."""
    torch.set_num_threads(1)
    torch.get_num_threads()  # settles the thread's first-use setting at 1


def take_team(threads: int) -> None:
    """The calling thread (the engine's) computes on `threads` torch threads from now on."""
    torch.set_num_threads(threads)
    _run_parallel_op()
    if torch.get_num_threads() != threads:  # another thread set the count in between
        torch.set_num_threads(threads)
        _run_parallel_op()
