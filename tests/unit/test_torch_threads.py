"""common/server/torch_threads.py: start-up leaves no torch team behind, the engine thread's
team is the process's only one, and each thread's count holds whatever another thread sets."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest
import torch

from common.server.torch_threads import (in_passing_thread, in_passing_thread_async,
                                         keep_one_thread, take_team)
from tests.helpers.cluster import REPO

# A service's start-up in a fresh process (no other test's threads): the demo model with
# sys.argv[1] torch threads, loaded and warmed up as the services do, then an engine thread's
# team; prints the process's thread counts along the way.
START_UP = """
import io, os, sys, threading
from common.config import ServiceConfig
from common.log import make_logger
from common.server.core_borrowing import CoreBorrowing
from common.server.runtime import build_service_runtime, warm_up
from common.server.torch_threads import in_passing_thread
import torch

def tasks():
    # the process's threads once none has ended for 0.2 s: a team's workers leave after
    # their thread, not with it
    import time
    count, steady = len(os.listdir("/proc/self/task")), 0
    while steady < 10:
        time.sleep(0.02)
        now = len(os.listdir("/proc/self/task"))
        count, steady = now, (steady + 1 if now == count else 0)
    return count

before = tasks()
config = ServiceConfig(model="demo", torch_threads=int(sys.argv[1]), pool_tokens=4096)
runtime = build_service_runtime(config, make_logger("decode", stream=io.StringIO()))
in_passing_thread(warm_up, runtime)
after_start_up = tasks()
seen = {}

def engine():
    CoreBorrowing(runtime.cores).on_engine_thread()
    a = torch.ones(512, 512)
    _ = a @ a
    seen["threads"], seen["tasks"] = torch.get_num_threads(), tasks()

thread = threading.Thread(target=engine)
thread.start()
thread.join()
print(after_start_up - before, seen["tasks"] - before, seen["threads"], torch.get_num_threads())
"""


def _start_up(threads: int) -> list[int]:
    out = subprocess.run([sys.executable, "-c", START_UP, str(threads)], cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    return [int(n) for n in out.split()[-4:]]


def test_start_up_leaves_only_the_engine_threads_team():
    """Two torch threads leave the threads one leaves (other libraries start some of their
    own either way), but for the engine thread's one worker."""
    one, two = _start_up(1), _start_up(2)
    assert two[0] == one[0]  # the loading and warm-up threads took their workers along
    assert two[1] == one[1] + 1  # the engine thread's team: it and one worker
    assert two[2:] == [2, 1] and one[2:] == [1, 1]  # engine's threads, the main thread's


def test_in_passing_thread_returns_and_raises_in_the_caller():
    names = []
    assert in_passing_thread(lambda x: names.append(threading.current_thread().name) or x,
                             7) == 7
    assert names == ["torch-start-up"]

    def fail():
        raise ValueError("no such model")
    with pytest.raises(ValueError, match="no such model"):
        in_passing_thread(fail)


def test_in_passing_thread_async_returns_and_raises():
    async def main():
        assert await in_passing_thread_async(lambda a, b: a + b, 2, 3) == 5

        def fail():
            raise KeyError("gone")
        with pytest.raises(KeyError):
            await in_passing_thread_async(fail)
    asyncio.run(main())


def _count_after_another_thread_sets(settle, others_count: int) -> int:
    """settle() on a thread; then this thread sets torch's count to others_count; then the
    first thread reads its own count."""
    settled, changed, seen = threading.Event(), threading.Event(), {}

    def worker() -> None:
        settle()
        settled.set()
        changed.wait(30)
        seen["threads"] = torch.get_num_threads()
    before = torch.get_num_threads()
    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert settled.wait(30)
        torch.set_num_threads(others_count)
    finally:
        changed.set()
        thread.join()
        torch.set_num_threads(before)
    return seen["threads"]


def test_the_engines_team_holds_when_another_thread_sets_a_count():
    assert _count_after_another_thread_sets(lambda: take_team(2), 1) == 2


def test_one_thread_holds_when_another_thread_sets_a_count():
    assert _count_after_another_thread_sets(keep_one_thread, 2) == 1
