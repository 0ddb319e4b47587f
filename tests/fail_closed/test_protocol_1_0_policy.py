"""D-44: decode refuses prefills that speak only protocol 1.0 unless its operator allowed them;
an allowed 1.0 handoff is served, counted, and still held to the content checks, while a 1.1
header is always held to the 1.1 binding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from common.config import DecodeConfig, ServiceConfig
from common.handoff.layout import protocol_version
from common.pb.kvhandoff.v1 import common_pb2, handoff_pb2
from conformance.decode_binding_edits import as_protocol_1_0, with_header_nonce, zeroed_layer
from conformance.decode_script import DecodeCase, refused, tokens
from decode_svc.server import _agree
from tests.fail_closed.harness import DecodeHarness

pytestmark = pytest.mark.slow


def _runtime(layout: common_pb2.KvLayout):
    capacity = SimpleNamespace(context_window=512, pool_tokens=1024, max_prompt_tokens=512)
    return SimpleNamespace(loaded=SimpleNamespace(fingerprint="fp", config=SimpleNamespace(
        vocab_size=98)), layout=SimpleNamespace(matches=lambda other: other == layout,
                                                to_proto=lambda: layout), capacity=capacity)


def _info(layout, *versions) -> handoff_pb2.GetPrefillInfoResponse:
    return handoff_pb2.GetPrefillInfoResponse(
        model_fingerprint="fp", layout=layout, protocol_versions=list(versions),
        max_prompt_tokens=512, max_context_tokens=512, vocab_size=98)


@pytest.mark.parametrize("allow", [False, True])
def test_the_handshake_refuses_a_1_0_prefill_unless_allowed(allow):
    layout = common_pb2.KvLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=1)
    config = DecodeConfig(ServiceConfig(), allow_protocol_1_0=allow)
    only_1_0 = _info(layout, common_pb2.ProtocolVersion(major=1, minor=0))
    limits, refusal = _agree(config, _runtime(layout), only_1_0, None)
    if allow:
        assert limits is not None and refusal == ""
    else:
        assert limits is None and "1.1" in refusal and "--allow-protocol-1-0" in refusal
    limits, refusal = _agree(config, _runtime(layout), _info(layout, protocol_version()), None)
    assert limits is not None and refusal == ""


@pytest.fixture(scope="module")
def allowing(tmp_path_factory):
    h = DecodeHarness(tmp_path_factory.mktemp("allow_1_0"), ("--allow-protocol-1-0",))
    yield h
    h.close()


def test_an_allowed_1_0_handoff_is_served_and_counted(allowing):
    before = allowing.stats_counters().get("handoffs_protocol_1_0", 0)
    run = allowing.play(DecodeCase("allowed_1_0", "D-44", "MUST", "", as_protocol_1_0, tokens()))
    assert run.tokens and run.tokens[0] == run.exchanges[0].reference_first_token
    assert allowing.stats_counters()["handoffs_protocol_1_0"] - before == 1
    assert allowing.pool_problem() is None
    lines = [line for line in allowing.decode.log_text().splitlines()
             if '"protocol_1_0_allowed"' in line]
    assert len(lines) == 1  # said once, at start


def test_an_allowed_1_0_handoff_is_still_content_checked(allowing):
    case = DecodeCase("allowed_1_0_zero_layer", "D-44", "MUST", "",
                      lambda i: as_protocol_1_0(_ScriptWith(i, zeroed_layer(i, -1))),
                      refused("KV_DEPTH_MISMATCH"), prompt_tokens=40)
    run = allowing.play(case)
    assert run.tokens == [] and run.outcome.reason == "KV_DEPTH_MISMATCH", run.outcome.describe()
    assert allowing.pool_problem() is None


def test_a_1_1_header_is_still_bound_when_1_0_is_allowed(allowing):
    run = allowing.play(DecodeCase("bound_1_1", "D-44", "MUST", "",
                                   lambda i: with_header_nonce(i, b""), refused("NONCE_MISMATCH")))
    assert run.tokens == [] and run.outcome.reason == "NONCE_MISMATCH", run.outcome.describe()


class _ScriptWith:
    """A ScriptInput whose good() is a given list of frames (to chain two edits)."""

    def __init__(self, inner, frames) -> None:
        self._inner, self._frames = inner, frames

    def good(self):
        return list(self._frames)

    def __getattr__(self, name):
        return getattr(self._inner, name)
