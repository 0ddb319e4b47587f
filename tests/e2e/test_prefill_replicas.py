"""Three prefill processes and one decode given the list (--prefill a,b,c): one scope's
requests that share a first page land on one replica (its GetStats prefix_cache_hits show it);
killing a replica (SIGKILL) while it holds handoffs and other streams run loses no request (the
held ones are asked again of the survivors, counted), and every survivor's pool and decode's
return to baseline.

To make "holds handoffs" exact without timing, the replica is paused (SIGSTOP) and sent only
requests whose favourite it is (computed with the chooser's own rendezvous), then killed."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from decode_svc.cache_scope import cache_scope
from decode_svc.prefill_choice import rendezvous_order, route_key
from tests.helpers.cluster import start_service
from tests.helpers.polling import wait_until
from tests.ops.helpers import generate_reply

pytestmark = pytest.mark.slow

PAGE = 4
FLAGS = ["--model", "demo", "--pool-tokens", "4096", "--page-size", str(PAGE)]
PREFIX = [3 + (5 * i) % 80 for i in range(12)]  # three whole pages


def counter(service, name: str) -> int:
    return service.stats().counters.get(name, 0)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    services = []
    try:
        prefills = [start_service("prefill", root / f"p{i}", FLAGS) for i in range(3)]
        services += prefills
        decode = start_service("decode", root / "d",
                               [*FLAGS, "--prefill", ",".join(p.address for p in prefills)])
        services.append(decode)
        yield prefills, decode
    finally:
        for service in reversed(services):
            if service.proc.poll() is None:
                os.kill(service.proc.pid, signal.SIGCONT)
            service.stop()


def favourite(prefills, salt: str, prompt: list[int]) -> int:
    key = route_key(cache_scope(b"", salt), prompt, PAGE)
    first = rendezvous_order(key, [p.address for p in prefills])[0]
    return [p.address for p in prefills].index(first)


def test_one_scope_meets_one_replica_cache(replicas):
    prefills, decode = replicas
    before = [(counter(p, "handoffs_completed"), counter(p, "prefix_cache_hits"))
              for p in prefills]
    for i in range(4):
        assert generate_reply(decode.address, PREFIX + [40 + i], 2,
                              cache_salt="tenant-a").completion_tokens == 2
    after = [(counter(p, "handoffs_completed"), counter(p, "prefix_cache_hits"))
             for p in prefills]
    served = [a[0] - b[0] for a, b in zip(after, before)]
    hits = [a[1] - b[1] for a, b in zip(after, before)]
    chosen = favourite(prefills, "tenant-a", PREFIX)
    assert served[chosen] == 4 and sum(served) == 4, served
    assert hits[chosen] == 3 and sum(hits) == 3, hits


def test_killing_a_replica_loses_no_request_before_its_first_token(replicas):
    prefills, decode = replicas
    victim = 2
    salts = [f"t{i}" for i in range(200)]
    doomed = [s for s in salts if favourite(prefills, s, PREFIX) == victim][:4]
    others = [s for s in salts if favourite(prefills, s, PREFIX) != victim][:4]
    assert len(doomed) == 4 and len(others) == 4
    retried_before = counter(decode, "handoff_retried_transport")
    os.kill(prefills[victim].proc.pid, signal.SIGSTOP)
    with ThreadPoolExecutor(12) as pool:
        held = [pool.submit(generate_reply, decode.address, PREFIX + [9], 3, 120, salt)
                for salt in doomed]
        # the survivors' requests finishing means decode has long since sent the held ones
        markers = [pool.submit(generate_reply, decode.address, PREFIX + [8], 2, 120, salt)
                   for salt in others]
        assert [f.result().completion_tokens for f in markers] == [2] * 4
        assert not any(f.done() for f in held)  # they wait inside the paused replica
        streams = [pool.submit(generate_reply, decode.address, PREFIX + [7], 32, 120, salt)
                   for salt in others]  # streams running from the survivors meanwhile
        os.kill(prefills[victim].proc.pid, signal.SIGKILL)
        prefills[victim].proc.wait(timeout=30)
        results = [f.result() for f in streams + held]  # raises on any failed request
    assert [r.completion_tokens for r in results] == [32] * 4 + [3] * 4
    assert counter(decode, "handoff_retried_transport") - retried_before == len(doomed)
    for service in (decode, *prefills[:victim]):
        wait_until(lambda s=service: (p := s.stats().pool).pages_free == p.pages_total, 10,
                   lambda s=service: f"{s.role} pool back at baseline: {s.stats().pool}")
