"""A prefill replica whose KV is wrong in content only (a broken variant: the KV of another
prompt of the same length, every id, digest and checksum right) behind one decode with a good
replica: each request whose favourite is the broken replica is refused there by decode's
layer-0 check, asked again of the good replica before any token, and completes; the refusals
count toward the broken replica's breaker, which ejects it after three; both pools that hold
pages return to baseline. Nothing is timed: counters and log lines say what happened."""

from __future__ import annotations

import pytest

from decode_svc.cache_scope import cache_scope
from decode_svc.prefill_breaker import DEFAULT_FAILURES_TO_EJECT
from decode_svc.prefill_choice import rendezvous_order, route_key
from tests.conformance.broken.process import start_variant
from tests.helpers.cluster import start_service
from tests.helpers.polling import wait_until
from tests.ops.helpers import generate_reply, log_events

pytestmark = pytest.mark.slow

PAGE = 4
FLAGS = ["--model", "demo", "--pool-tokens", "4096", "--page-size", str(PAGE)]
PROMPT = [3 + (5 * i) % 80 for i in range(13)]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("content_retry")
    services = []
    try:
        good = start_service("prefill", root / "good", FLAGS)
        services.append(good)
        broken = start_variant("prefill_kv_of_another_prompt", "prefill", root / "broken", FLAGS)
        services.append(broken)
        decode = start_service("decode", root / "d",
                               [*FLAGS, "--prefill", f"{good.address},{broken.address}"])
        services.append(decode)
        yield good, broken, decode
    finally:
        for service in reversed(services):
            service.stop()


def _counter(service, name: str) -> int:
    return service.stats().counters.get(name, 0)


def test_content_refusals_are_retried_on_another_replica_and_eject_the_sender(replicas):
    good, broken, decode = replicas
    names = [good.address, broken.address]
    salts = [s for s in (f"t{i}" for i in range(100)) if rendezvous_order(
        route_key(cache_scope(b"", s), PROMPT, PAGE), names)[0] == broken.address]
    salts = salts[:DEFAULT_FAILURES_TO_EJECT]
    assert len(salts) == DEFAULT_FAILURES_TO_EJECT
    for salt in salts:  # one at a time: each reaches the broken favourite while it is allowed
        assert generate_reply(decode.address, PROMPT, 3, cache_salt=salt).completion_tokens == 3
    assert _counter(decode, "handoff_retried_refused") == len(salts)
    assert _counter(decode, "prefill_ejected") == 1
    assert _counter(good, "handoffs_completed") == len(salts)
    retried = [e for e in log_events(decode) if e.get("event") == "handoff_retried"]
    assert {e["refusal"] for e in retried} == {"KV_LAYER0_MISMATCH"}
    assert {e["replica"] for e in retried} == {broken.address}
    for service in (decode, good, broken):
        wait_until(lambda s=service: (p := s.stats().pool).pages_free == p.pages_total, 10,
                   lambda s=service: f"{s.role} pool back at baseline: {s.stats().pool}")
