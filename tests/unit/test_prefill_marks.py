"""Prefill's `prefill_streamed` line carries where the request's time went on prefill
(`marks_ago_ms`: ms from each milestone to the line), in the order they happen, so
bench/ttft_trace.py can place them beside decode's timeline."""

from __future__ import annotations

import torch

from common.handoff.layout import KvLayout
from common.pb.kvhandoff.v1 import handoff_pb2
from prefill_svc.servicer import marks_ago_ms
from tests.helpers.prefill_servicer import prefill_request, run_prefill

LAYOUT = KvLayout(num_layers=3, num_kv_heads=1, head_dim=4, dtype=torch.float32)
ORDER = ["received", "admitted", "first_chunk_emitted", "last_chunk_emitted", "commit_emitted"]


def test_marks_ago_ms_lists_the_earliest_first_with_its_distance_to_now():
    ago = marks_ago_ms({"b": 10.0, "a": 5.0, "c": 10.5})
    assert list(ago) == ["a", "b", "c"]
    assert ago["a"] - ago["b"] == 5000.0 and ago["b"] - ago["c"] == 500.0
    assert ago["c"] >= 0


async def test_the_streamed_line_carries_the_request_s_marks_in_order():
    frames, error, events = await run_prefill(LAYOUT, prefill_request("r-1", [3, 4, 5, 6]))
    assert error is None, error
    assert frames[-1].commit.status == handoff_pb2.HANDOFF_STATUS_OK
    streamed = [e for e in events if e["event"] == "prefill_streamed"]
    assert len(streamed) == 1, events
    marks = streamed[0]["marks_ago_ms"]
    assert list(marks) == ORDER, marks
    ago = [marks[name] for name in ORDER]
    assert ago == sorted(ago, reverse=True) and ago[-1] >= 0, marks
