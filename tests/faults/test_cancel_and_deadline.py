"""The client cancelling mid-generation or mid-handoff gets CANCELLED; a deadline shorter than
the prefill gets DEADLINE_EXCEEDED within the deadline plus one second. Each time both pools go
back to their baseline and the next request's greedy output is the same as before."""

from __future__ import annotations

import grpc
import pytest

from tests.faults.slow_cluster import (
    SLOW_DECODE_PROMPT,
    SLOW_PREFILL_PROMPT,
    checkpoint,
    normal_output,
    start_decode,
    start_prefill,
)
from tests.faults.waits import StreamCall, wait_baseline, wait_pages_taken
from tests.helpers.cluster import Cluster

pytestmark = pytest.mark.slow

DEADLINE = 30.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("cancel")
    model = checkpoint(root)
    prefill = start_prefill(model, root / "run")
    try:
        decode = start_decode(model, root / "run", prefill)
    except Exception:
        prefill.stop()
        raise
    cluster = Cluster(prefill, decode)
    yield cluster, normal_output(cluster.address)
    cluster.stop()


def _settled(cluster: Cluster, before: list[int]) -> None:
    wait_baseline(cluster.decode)
    wait_baseline(cluster.prefill)
    assert normal_output(cluster.address) == before
    wait_baseline(cluster.decode)
    wait_baseline(cluster.prefill)


def test_client_cancels_mid_generation(served):
    cluster, before = served
    call = StreamCall(cluster.address, SLOW_DECODE_PROMPT, 100, DEADLINE).start()
    call.wait_tokens(2)
    assert call.call.cancel()
    code, _ = call.outcome(DEADLINE + 1)
    assert code == grpc.StatusCode.CANCELLED
    assert 2 <= len(call.tokens) < 100
    _settled(cluster, before)


def test_client_cancels_mid_handoff(served):
    cluster, before = served
    call = StreamCall(cluster.address, SLOW_PREFILL_PROMPT, 8, DEADLINE).start()
    wait_pages_taken(cluster.prefill)
    assert call.call.cancel()
    code, _ = call.outcome(DEADLINE + 1)
    assert code == grpc.StatusCode.CANCELLED
    assert call.tokens == []
    _settled(cluster, before)


def test_deadline_shorter_than_the_prefill(served):
    cluster, before = served
    deadline = 1.0  # the slow prefill streams for several seconds
    call = StreamCall(cluster.address, SLOW_PREFILL_PROMPT, 8, deadline).start()
    code, _ = call.outcome(deadline + 5)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert call.elapsed <= deadline + 1
    assert call.tokens == []
    _settled(cluster, before)
