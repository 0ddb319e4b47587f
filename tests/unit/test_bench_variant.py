"""`kvhandoff bench serve --variant`: the spec of a named A/B pair parses into its flags, and a
spec that cannot name a distinct system is refused with a message naming the form."""

from __future__ import annotations

import pytest

from bench.servers import Variant


def test_prefill_and_decode_flags_split_at_the_semicolon():
    v = Variant.parse("t2=--torch-threads 2 --cpu-affinity 0-1;--torch-threads 2")
    assert v == Variant("t2", ("--torch-threads", "2", "--cpu-affinity", "0-1"),
                        ("--torch-threads", "2"))


def test_prefill_flags_only():
    assert Variant.parse("b1024=--max-batch-tokens 1024") == Variant(
        "b1024", ("--max-batch-tokens", "1024"), ())


@pytest.mark.parametrize("text", ["--max-batch-tokens 1024", "=--x 1", "local=--x 1",
                                  "a b=--x 1", "disaggregated="])
def test_a_spec_without_a_distinct_name_is_refused(text):
    with pytest.raises(ValueError, match="NAME=PREFILL FLAGS"):
        Variant.parse(text)
