"""Property: for random corruptions of a valid handoff, decode emits a token exactly when the
corrupted stream is still a valid handoff by the spec (byte-identical or changed only where the
protocol cannot tell), and refuses with no token otherwise; its pool always returns to baseline.

Corruptions change framing and also payload values with every checksum recomputed
(`reseal_value`): such a stream is well formed, and only decode's content checks refuse it."""

from __future__ import annotations

from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings

from conformance.decode_script import DecodeCase, ScriptInput, tokens
from tests.fail_closed.corruptions import Corruption, corruptions, still_valid

pytestmark = pytest.mark.slow


def test_decode_never_emits_for_a_corrupted_handoff(harness):
    verdicts: Counter = Counter()

    @settings(max_examples=25, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(changes=corruptions)
    # payload values changed and resealed, always among the draws (layer 0, the last position of
    # a deeper layer, NaN), so the content half of the property never goes untested
    @example(changes=[Corruption("reseal_value", where=0, other=2, value=3)])
    @example(changes=[Corruption("reseal_value", where=5, other=41, value=4)])
    @example(changes=[Corruption("reseal_value", where=3, other=7, value=9)])
    def check(changes):
        seen = {}

        def script(i: ScriptInput) -> list[bytes]:
            frames = [f.SerializeToString() for f in i.good()]
            seen["content"] = False
            for change in changes:
                changed = change.apply(frames)
                seen["content"] |= change.kind == "reseal_value" and changed != frames
                frames = changed
            seen["valid"] = (still_valid(i.request, harness.fake.info, frames)
                             and not seen["content"])
            seen["identical"] = frames == [f.SerializeToString() for f in i.good()]
            return frames

        run = harness.play(DecodeCase("corruption", "D-24", "MUST", "", script, tokens()))
        assert run.exchanges and not run.exchanges[0].error, run.outcome.describe()
        verdict = "identical" if seen["identical"] else "valid" if seen["valid"] else "corrupt"
        verdicts[verdict] += 1
        verdicts["content"] += seen["content"]
        if verdict == "corrupt":
            assert run.tokens == [], f"{changes}: {run.tokens}"
            assert run.outcome.code != grpc.StatusCode.OK
            assert run.outcome.reason is not None, run.outcome.describe()
        else:
            assert run.outcome.code == grpc.StatusCode.OK, f"{changes}: {run.outcome.describe()}"
            assert run.tokens, changes
        assert harness.pool_problem() is None

    check()
    assert verdicts["corrupt"] >= 10, verdicts  # the property was exercised, not vacuous
    assert verdicts["content"] >= 3, verdicts  # and payload values were corrupted, resealed
