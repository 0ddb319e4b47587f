"""The CPU column of `bench serve`: a server's CPU time counts its child processes (vLLM's API
server forks its engine core), read from /proc."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.server_cpu import check_pids, process_tree, tree_cpu_seconds
from bench.cpu_clock import process_cpu_seconds

# a parent that sleeps while its child burns ~0.5 s of CPU and then waits for stdin
PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import sys, time\\n"
    "end = time.process_time() + 0.5\\n"
    "while time.process_time() < end: pass\\n"
    "print('busy done', flush=True); sys.stdin.read()"], stdout=sys.stdout, stdin=subprocess.PIPE)
print(child.pid, flush=True)
sys.stdin.read()
child.stdin.close()
child.wait()
"""


def test_the_tree_counts_a_busy_child_of_an_idle_parent():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "busy done"
        assert process_tree([parent.pid]) == sorted([parent.pid, child])
        total = tree_cpu_seconds([parent.pid])
        assert total >= 0.45 and total > process_cpu_seconds(parent.pid) + 0.4
    finally:
        parent.stdin.close()
        parent.wait(timeout=30)


def test_a_pid_that_is_not_running_is_refused():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with pytest.raises(ValueError, match=f"no process {gone.pid}"):
        check_pids([gone.pid])
