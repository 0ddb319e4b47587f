"""What the NIXL plane tests share: UCX confined to loopback, and a skip where NIXL can't run.

UCX reads its settings from the environment: UCX_NET_DEVICES=lo keeps its TCP transport (used
for connection setup, and for data where no shared-memory transport applies) on 127.0.0.1;
UCX_TLS names the transports it may use (shared memory, TCP, and self for the same process).
Tests pass LOOPBACK_UCX to every process they start, and set it in their own process before an
agent is created.
"""

from __future__ import annotations

import os

import pytest

from common.handoff.nixl_agent import LOOPBACK_UCX, open_agent


READ_TIMEOUT_S = 1.0  # decode's --nixl-read-timeout-s in these tests


def use_loopback_ucx() -> None:
    os.environ.update(LOOPBACK_UCX)


def nixl_or_skip():
    """An agent for the test's own process, or a skip with the reason NIXL is not usable."""
    use_loopback_ucx()
    agent, why = open_agent("test")
    if agent is None:
        pytest.skip(why)
    return agent
