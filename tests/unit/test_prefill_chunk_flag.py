"""--prefill-chunk-tokens: a prefill setting (flag, TOML, range-checked), which `kvhandoff up`
hands on to the prefill it starts in a form prefill's own parser reads."""

from __future__ import annotations

import pytest

from common.config import PrefillConfig, ServiceConfig
from kvhandoff_cli import up
from kvhandoff_cli.main import _service_parser
from kvhandoff_cli.settings import build_config, resolve


def _prefill_config(argv: list[str]) -> PrefillConfig:
    ns, _ = resolve(_service_parser("prefill"), argv, "prefill", {})
    return build_config(ns, "prefill")


def test_the_flag_sets_the_config_field():
    assert _prefill_config([]).prefill_chunk_tokens == PrefillConfig(ServiceConfig()) \
        .prefill_chunk_tokens
    assert _prefill_config(["--prefill-chunk-tokens", "64"]).prefill_chunk_tokens == 64


def test_a_chunk_below_one_token_is_refused():
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        _prefill_config(["--prefill-chunk-tokens", "0"])


def test_up_hands_the_chunk_to_prefill():
    args = up.parser().parse_args(["--prefill-chunk-tokens", "96"])
    assert _prefill_config(up._chunk_flag(args.prefill_chunk_tokens)).prefill_chunk_tokens == 96
    assert up._chunk_flag(up.parser().parse_args([]).prefill_chunk_tokens) == []
