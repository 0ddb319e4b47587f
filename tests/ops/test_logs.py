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


def test_prefill_logs_only_the_tokens_the_prefix_cache_gave(ops_cluster):
    """prefill_streamed's cached_tokens is the prefix taken from the cache, not the prompt."""
    prompt = [3 + (7 * i) % 90 for i in range(41)]  # 2 whole pages of 16 and 9 tokens
    cached = {}
    for label, salt in (("cold", "logs-cache-test"), ("warm", "logs-cache-test"),
                        ("unscoped", "")):
        reply = generate_reply(ops_cluster.address, prompt, 2, cache_salt=salt)
        streamed = [e for e in _request_events(ops_cluster.prefill, reply.request_id,
                                               PREFILL_PHASES)
                    if e["event"] == "prefill_streamed"]
        assert len(streamed) == 1, streamed
        cached[label] = streamed[0]["cached_tokens"]
    assert cached == {"cold": 0, "warm": 32, "unscoped": 0}


def test_every_log_line_is_a_json_event(ops_cluster):
    generate_reply(ops_cluster.address, [7, 8, 9], 2)
    for service in (ops_cluster.prefill, ops_cluster.decode):
        lines = [line for line in service.log_text().splitlines() if line.strip()]
        events = log_events(service)
        assert len(events) == len(lines), [x for x in lines if not x.startswith("{")][:5]
        for event in events:
            assert {"event", "level", "timestamp", "service"} <= set(event), event
            assert event["timestamp"].endswith("Z")
