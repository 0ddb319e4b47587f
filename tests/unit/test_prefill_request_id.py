"""Prefill's log lines of a request carry the x-request-id decode sent, so they join decode's
lines even when the PrefillRequest itself names no request id (MISSING_REQUEST_ID)."""

from __future__ import annotations

import torch

from common.handoff.layout import KvLayout
from common.log import REQUEST_ID_METADATA
from tests.helpers.prefill_servicer import prefill_request, run_prefill

LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)


async def _prefill_log_events(request, metadata) -> list[dict]:
    _, _, events = await run_prefill(LAYOUT, request, metadata)
    return events


def _request(request_id: str):
    return prefill_request(request_id, [3, 4, 5])


async def test_a_rejection_without_request_id_is_logged_under_decodes_x_request_id():
    events = await _prefill_log_events(_request(""), ((REQUEST_ID_METADATA, "decode-id-1"),))
    rejected = [e for e in events if e["event"] == "prefill_rejected"]
    assert [e["reason"] for e in rejected] == ["MISSING_REQUEST_ID"]
    assert rejected[0]["request_id"] == "decode-id-1"


async def test_without_metadata_the_prefill_request_id_is_logged():
    events = await _prefill_log_events(_request("r-7"), None)
    phases = {e["event"]: e for e in events if e.get("request_id") == "r-7"}
    assert {"prefill_started", "prefill_streamed"} <= set(phases), events
