"""D-90's pages are the prefill's: decode bounds a commit's cached_tokens by the page size the
prefill replicas advertise (their greatest common divisor), never by its own --page-size, so a
prefill with other pages than decode's gets its honest cache hits accepted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from common.config import DecodeConfig, ServiceConfig
from common.handoff.layout import protocol_version
from common.pb.kvhandoff.v1 import common_pb2, handoff_pb2
from decode_svc.server import _agree_replicas

LAYOUT = common_pb2.KvLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=1)


def _runtime():
    capacity = SimpleNamespace(context_window=512, pool_tokens=1024, max_prompt_tokens=512,
                               page_size=32)  # decode's own pages: not the ones D-90 counts
    return SimpleNamespace(loaded=SimpleNamespace(fingerprint="fp", config=SimpleNamespace(
        vocab_size=98)), layout=SimpleNamespace(matches=lambda other: other == LAYOUT,
                                                to_proto=lambda: LAYOUT), capacity=capacity)


def _info(page_size: int) -> handoff_pb2.GetPrefillInfoResponse:
    return handoff_pb2.GetPrefillInfoResponse(
        model_fingerprint="fp", layout=LAYOUT, protocol_versions=[protocol_version()],
        max_prompt_tokens=512, max_context_tokens=512, vocab_size=98, page_size=page_size)


@pytest.mark.parametrize("pages, agreed", [([16], 16), ([16, 24], 8), ([8, 16, 32], 8),
                                           ([0], 0), ([0, 16], 16)])
def test_the_cached_page_size_is_the_replicas_gcd(pages, agreed):
    infos = [(f"127.0.0.1:{i + 1}", _info(p)) for i, p in enumerate(pages)]
    limits, refusal, _, _ = _agree_replicas(DecodeConfig(ServiceConfig()), _runtime(), infos,
                                            None, nixl=False)
    assert refusal == "" and limits.prefill_page_size == agreed
