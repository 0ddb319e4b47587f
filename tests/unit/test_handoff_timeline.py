"""decode's per-request timeline in the `handoff_verified` log line (decode_svc.lifecycle)."""

from __future__ import annotations

from common.handoff.transfer import TransferRecord
from decode_svc.lifecycle import handoff_timeline


def test_milestones_in_time_order_as_ms_since_arrival():
    record = TransferRecord("r", "inline")
    record.marks.update({"first_chunk": 10.004, "call_opened": 10.001, "stream_ended": 10.05})
    timeline = handoff_timeline(10.0, 10.0005, record, 10.0625)
    assert list(timeline) == ["reserved", "call_opened", "first_chunk", "stream_ended",
                              "verified"]
    assert timeline == {"reserved": 0.5, "call_opened": 1.0, "first_chunk": 4.0,
                        "stream_ended": 50.0, "verified": 62.5}


def test_a_mark_keeps_the_first_time_it_was_reached():
    record = TransferRecord("r", "inline")
    record.mark("first_frame")
    first = record.marks["first_frame"]
    record.mark("first_frame")
    assert record.marks["first_frame"] == first
