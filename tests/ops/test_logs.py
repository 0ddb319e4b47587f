"""structlog JSON logs: every line is one JSON event with level, time and service, and the
prefill and decode lines of one request carry the same request id."""

from __future__ import annotations

import pytest

from tests.helpers.polling import wait_until
from tests.ops.helpers import generate_reply, log_events

pytestmark = pytest.mark.slow

DECODE_PHASES = {"handoff_verified", "request_finished"}
PREFILL_PHASES = {"prefill_started", "prefill_streamed"}


def _request_events(service, request_id: str, phases: set[str]) -> list[dict]:
    """The service's events for request_id, once the phases are written (logs are async)."""
    def events() -> list[dict]:
        return [e for e in log_events(service) if e.get("request_id") == request_id]

    wait_until(lambda: phases <= {e["event"] for e in events()}, 10,
               lambda: f"{service.role} logged {sorted(phases)} for {request_id}: {events()}")
    return events()


def test_one_request_id_joins_prefill_and_decode_lines(ops_cluster):
    reply = generate_reply(ops_cluster.address, list(range(3, 40)), 4)
    assert len(reply.request_id) >= 16
    decode = _request_events(ops_cluster.decode, reply.request_id, DECODE_PHASES)
    prefill = _request_events(ops_cluster.prefill, reply.request_id, PREFILL_PHASES)
    assert DECODE_PHASES <= {e["event"] for e in decode}, decode
    assert PREFILL_PHASES <= {e["event"] for e in prefill}, prefill
    assert {e["service"] for e in decode} == {"decode"}
    assert {e["service"] for e in prefill} == {"prefill"}


def test_every_log_line_is_a_json_event(ops_cluster):
    generate_reply(ops_cluster.address, [7, 8, 9], 2)
    for service in (ops_cluster.prefill, ops_cluster.decode):
        lines = [line for line in service.log_text().splitlines() if line.strip()]
        events = log_events(service)
        assert len(events) == len(lines), [x for x in lines if not x.startswith("{")][:5]
        for event in events:
            assert {"event", "level", "timestamp", "service"} <= set(event), event
            assert event["timestamp"].endswith("Z")
