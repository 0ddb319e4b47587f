"""Decode's replica set and the retry before the first token, with a scripted receiver that
opens real (doomed) Prefill calls through PrefillReplicas: unhealthy and ejected replicas are
skipped, a transport failure is asked again on another replica with a fresh nonce, a refusal is
never asked again on the same replica, a deadline is never retried, in-flight counts return to
zero, and a replica that keeps failing is ejected and comes back after its cool-down. A content
refusal (the job's check, run inside each attempt) counts against the replica that sent the KV
and is retried on another, never the same one; non-finite KV is counted but not retried; a check
that cannot run says nothing of the replica."""

from __future__ import annotations

import dataclasses
import io

import grpc
import torch
import pytest

from common.counters import Counters
from common.errors import ServiceError
from common.handoff.layout import KvLayout
from common.handoff.reasons import HandoffRefused, refuse
from common.handoff.transfer import TransferRecord, TransferState
from common.handoff.verifier import Expectation
from common.log import make_logger
from common.pb.kvhandoff.v1 import handoff_pb2
from common.sampling import SamplingConfig
from decode_svc.handoff_retry import RetryingReceiver
from decode_svc.kv_receiver import HandoffJob, KvReceiver, LandedKv
from decode_svc.prefill_breaker import BreakerConfig
from decode_svc.prefill_choice import PrefixAwareChooser
from common.server.prefill_target import parse_target
from decode_svc.prefill_replicas import PrefillReplicas

# closed loopback ports: every call made is doomed, and the scripted receiver cancels it anyway
TARGET = "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"
NAMES = TARGET.split(",")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Scripted(KvReceiver):
    """Opens the call through the replica set as the real receivers do, then answers what the
    script says for the replica it reached: an exception to raise, or None for success."""

    plane = "inline"

    def __init__(self, replicas: PrefillReplicas, script: dict[str, BaseException | None]):
        self.replicas = replicas
        self.script = script
        self.seen: list[tuple[str, bytes]] = []

    async def receive(self, job: HandoffJob, record: TransferRecord) -> LandedKv:
        call = self.replicas.prefill(job.request, job.timeout_s)
        call.cancel()
        name = self.replicas.last_tried(job.request.request_id)
        self.seen.append((name, bytes(job.request.nonce)))
        assert job.expect.nonce == job.request.nonce
        outcome = self.script.get(name)
        if outcome is not None:
            record.move(TransferState.FAILED, getattr(outcome, "reason", ""))
            raise outcome
        record.move(TransferState.SUCCESS)
        return LandedKv(7, 0, True)


def make(script, clock=None, failures_to_eject=3, retries=2):
    clock = clock or Clock()
    log = make_logger("decode", io.StringIO())
    ejected: list[str] = []
    replicas = PrefillReplicas(TARGET, 1 << 20, None, PrefixAwareChooser(), 4, log,
                               BreakerConfig(failures_to_eject, 10.0),
                               on_eject=ejected.append, clock=clock)
    for replica in replicas.replicas.values():
        replica.serving = True
    inner = Scripted(replicas, script)
    retried: list[str] = []
    receiver = RetryingReceiver(inner, replicas, Counters(), retried.append, log, retries,
                                clock=clock)
    return replicas, inner, receiver, retried, ejected


def job(request_id="r1", scope=b"tenant", tokens=(1, 2, 3, 4, 5)) -> HandoffJob:
    request = handoff_pb2.PrefillRequest(request_id=request_id, token_ids=list(tokens),
                                         nonce=b"n" * 16, cache_scope=scope)
    expect = Expectation(request_id, len(tokens), KvLayout(2, 2, 8, torch.float32), "fp",
                         1 << 20, 32, b"n" * 16)
    return HandoffJob(request, expect, SamplingConfig(), 30.0)


def unavailable() -> HandoffRefused:
    return refuse("PEER_UNAVAILABLE", "prefill failed mid-handoff: UNAVAILABLE")


async def test_transport_failure_is_retried_on_another_replica_with_a_fresh_nonce():
    replicas, inner, receiver, retried, _ = make({})
    favourite = replicas.chooser.choose(*_key_and_candidates(replicas, job()))
    inner.script[favourite] = unavailable()
    landed = await receiver.receive(job(), TransferRecord("r1", "inline"))
    assert landed.first_token == 7
    (first, n1), (second, n2) = inner.seen
    assert first == favourite and second != favourite
    assert n1 == b"n" * 16 and n2 != n1 and len(n2) == 16
    assert retried == ["transport"]
    assert all(r.in_flight == 0 for r in replicas.replicas.values())
    assert replicas.last_tried("r1") == ""  # forgotten once the request is done
    await replicas.close()


async def test_at_most_two_retries_then_the_refusal_passes_on():
    replicas, inner, receiver, retried, _ = make({n: unavailable() for n in NAMES})
    with pytest.raises(HandoffRefused) as caught:
        await receiver.receive(job(), TransferRecord("r1", "inline"))
    assert caught.value.reason == "PEER_UNAVAILABLE"
    assert sorted(name for name, _ in inner.seen) == sorted(NAMES)  # each replica once
    assert retried == ["transport", "transport"]
    await replicas.close()


async def test_a_refusal_is_never_asked_again_of_the_same_replica():
    bad = refuse("CHECKSUM_MISMATCH", "chunk 3's payload checksum")
    replicas, inner, receiver, retried, _ = make({})
    inner.script = {n: bad for n in NAMES[:2]}
    await receiver.receive(job(scope=b""), TransferRecord("r1", "inline"))
    names = [name for name, _ in inner.seen]
    assert len(names) == len(set(names))  # never the same replica twice
    assert names[-1] == NAMES[2]
    assert retried == ["refused"] * (len(names) - 1)
    await replicas.close()


async def test_a_single_replica_is_not_retried_and_a_deadline_never_is():
    replicas, inner, receiver, retried, _ = make({})
    for name in NAMES[1:]:
        replicas.replicas[name].serving = False  # unhealthy: skipped
    inner.script[NAMES[0]] = unavailable()
    with pytest.raises(HandoffRefused):
        await receiver.receive(job(), TransferRecord("r1", "inline"))
    assert [n for n, _ in inner.seen] == [NAMES[0]] and retried == []
    for name in NAMES:
        replicas.replicas[name].serving = True
    inner.seen.clear()
    inner.script = {n: refuse("HANDOFF_TIMEOUT", "slow") for n in NAMES}
    with pytest.raises(HandoffRefused):
        await receiver.receive(job("r2"), TransferRecord("r2", "inline"))
    assert len(inner.seen) == 1 and retried == []
    await replicas.close()


async def test_health_steers_but_never_empties_the_choice():
    # one replica serving: the others are skipped
    replicas, inner, receiver, _, _ = make({})
    for name in NAMES[1:]:
        replicas.replicas[name].serving = False
    for i in range(6):
        await receiver.receive(job(f"r{i}"), TransferRecord(f"r{i}", "inline"))
    assert {n for n, _ in inner.seen} == {NAMES[0]}
    # none known to serve (a watch not yet caught up with a channel that just connected, as
    # when decode starts before its prefill listens): the attempt itself is made and tells
    for replica in replicas.replicas.values():
        replica.serving = False
    inner.seen.clear()
    await receiver.receive(job("r9"), TransferRecord("r9", "inline"))
    assert len(inner.seen) == 1
    await replicas.close()


async def test_no_replica_at_all_is_a_peer_unavailable_refusal():
    replicas, inner, receiver, _, _ = make({})
    for replica in replicas.replicas.values():
        replica.removed = True  # every address left the DNS answer
    with pytest.raises(HandoffRefused) as caught:
        replicas.prefill(job().request, 1.0)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no prefill replica can take the handoff" in caught.value.message
    await replicas.close()


async def test_a_failing_replica_is_ejected_then_trialled_after_its_cool_down():
    clock = Clock()
    replicas, inner, receiver, retried, ejected = make({}, clock, failures_to_eject=2)
    favourite = replicas.chooser.choose(*_key_and_candidates(replicas, job()))
    inner.script[favourite] = unavailable()
    for i in range(2):
        await receiver.receive(job(f"r{i}"), TransferRecord(f"r{i}", "inline"))
    assert ejected == [favourite] and replicas.num_ejected() == 1
    inner.seen.clear()
    await receiver.receive(job("r9"), TransferRecord("r9", "inline"))
    assert [n for n, _ in inner.seen] != [favourite] and len(inner.seen) == 1  # skipped
    clock.now += 10.0
    inner.script.clear()  # it recovered
    inner.seen.clear()
    await receiver.receive(job("r10"), TransferRecord("r10", "inline"))
    assert [n for n, _ in inner.seen] == [favourite] and replicas.num_ejected() == 0
    await replicas.close()


async def test_the_breakers_never_empty_the_choice():
    clock = Clock()
    replicas, inner, receiver, _, ejected = make({}, clock, failures_to_eject=1, retries=0)
    for name in NAMES[1:]:
        replicas.replicas[name].serving = False
    inner.script[NAMES[0]] = refuse("CHECKSUM_MISMATCH", "bad")
    with pytest.raises(HandoffRefused):
        await receiver.receive(job("r1"), TransferRecord("r1", "inline"))
    assert ejected == [NAMES[0]]
    inner.script.clear()  # the only replica, ejected, still serves the next request
    await receiver.receive(job("r2"), TransferRecord("r2", "inline"))
    assert [n for n, _ in inner.seen] == [NAMES[0], NAMES[0]]
    await replicas.close()


def test_targets_parse_and_bad_entries_are_named():
    entries = parse_target("127.0.0.21:1,localhost:2, prefill:50061,[::1]:3")
    assert [(e.host, e.resolve) for e in entries] == [
        ("127.0.0.21", False), ("localhost", False), ("prefill", True), ("[::1]", False)]
    with pytest.raises(ValueError, match="'127.0.0.21' is not HOST:PORT"):
        parse_target("127.0.0.1:5,127.0.0.21")


def _key_and_candidates(replicas: PrefillReplicas, j: HandoffJob):
    from decode_svc.prefill_choice import Candidate, route_key
    return (route_key(j.request.cache_scope, j.request.token_ids, 4),
            [Candidate(n, 0) for n in NAMES])


# ---- content refusals (decode's layer-0/depth checks run inside each attempt, via job.check) --
def with_content_check(replicas: PrefillReplicas, j: HandoffJob, verdicts: dict):
    """j with a content check that refuses (or fails) as `verdicts` says for the replica the
    attempt reached, and otherwise passes with decode's own first token 9; -> (job, checked)."""
    checked: list[tuple[str, bytes]] = []

    async def check(landed: LandedKv, attempt: HandoffJob) -> LandedKv:
        name = replicas.last_tried(attempt.request.request_id)
        checked.append((name, bytes(attempt.request.nonce)))
        if name in verdicts:
            raise verdicts[name]
        return dataclasses.replace(landed, first_token=9, content_checked=True)
    return dataclasses.replace(j, check=check), checked


async def test_a_content_refusal_counts_against_its_replica_and_is_retried_elsewhere():
    replicas, inner, receiver, retried, ejected = make({}, failures_to_eject=1)
    favourite = replicas.chooser.choose(*_key_and_candidates(replicas, job()))
    j, checked = with_content_check(replicas, job(), {
        favourite: refuse("KV_LAYER0_MISMATCH", "layer 0 differs")})
    landed = await receiver.receive(j, TransferRecord("r1", "inline"))
    assert landed.content_checked and landed.first_token == 9  # the second replica's, checked
    assert [n for n, _ in checked] == [n for n, _ in inner.seen]  # every attempt checked
    (first, n1), (second, n2) = checked
    assert first == favourite and second != favourite and n1 != n2  # a fresh nonce
    assert retried == ["refused"]
    assert ejected == [favourite]  # the refusal was the favourite's failure
    assert replicas.replicas[second].breaker.failures == 0
    await replicas.close()


async def test_a_content_refusal_is_never_asked_again_of_the_same_replica():
    replicas, inner, receiver, retried, _ = make({})
    bad = refuse("KV_DEPTH_MISMATCH", "depth differs")
    j, checked = with_content_check(replicas, job(), {n: bad for n in NAMES})
    with pytest.raises(HandoffRefused) as caught:
        await receiver.receive(j, TransferRecord("r1", "inline"))
    assert caught.value.reason == "KV_DEPTH_MISMATCH"
    assert sorted(n for n, _ in checked) == sorted(NAMES)  # each replica once
    assert retried == ["refused", "refused"]
    assert all(r.breaker.failures == 1 for r in replicas.replicas.values())
    await replicas.close()


async def test_non_finite_kv_counts_against_its_replica_and_is_retried_on_a_clean_record():
    replicas, inner, receiver, retried, ejected = make({}, failures_to_eject=1)
    forgotten: list[tuple[str, int]] = []

    async def new_attempt(request_id: str) -> None:  # the engine forgets the failed writes
        forgotten.append((request_id, len(inner.seen)))

    receiver.new_attempt = new_attempt
    favourite = replicas.chooser.choose(*_key_and_candidates(replicas, job()))
    j, checked = with_content_check(replicas, job(), {
        favourite: refuse("KV_NOT_FINITE", "NaN")})
    landed = await receiver.receive(j, TransferRecord("r1", "inline"))
    assert landed.content_checked
    assert [n for n, _ in checked][0] == favourite and len(checked) == 2
    assert retried == ["refused"] and ejected == [favourite]
    assert forgotten == [("r1", 1)]  # once, after the failed attempt, before the retry asked
    await replicas.close()


async def test_a_content_check_that_cannot_run_says_nothing_of_the_replica():
    replicas, inner, receiver, retried, ejected = make({}, failures_to_eject=1)
    favourite = replicas.chooser.choose(*_key_and_candidates(replicas, job()))
    j, _ = with_content_check(replicas, job(), {favourite: ServiceError(
        grpc.StatusCode.INTERNAL, "CONTENT_CHECK_FAILED", "decode could not check")})
    with pytest.raises(ServiceError) as caught:
        await receiver.receive(j, TransferRecord("r1", "inline"))
    assert caught.value.reason == "CONTENT_CHECK_FAILED" and retried == [] and ejected == []
    assert replicas.replicas[favourite].breaker.failures == 0
    await replicas.close()
