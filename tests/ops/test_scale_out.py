"""Scale-out: two prefill replicas behind one decode, which chooses a replica per request
(unscoped requests by load, decode_svc/prefill_choice.py). Losing a replica fails no request
that had not received a token: the handoffs it held are asked again of the survivor
(decode_svc/handoff_retry.py); new requests go to the survivor.

To make "the requests it held" exact without timing, replica A is paused (SIGSTOP) before a
burst of requests: the choice still sends it some, which then wait inside A; the rest finish
on B. Killing A (SIGKILL) must retry exactly the waiting ones on B. A replica that drains
(SIGTERM) instead must get no new handoffs while it finishes its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from kvhandoff_cli.health_probe import check
from tests.helpers.cluster import REPO, start_service
from tests.helpers.polling import wait_until
from tests.ops.helpers import generate_reply

pytestmark = pytest.mark.slow

FLAGS = ["--model", "demo", "--pool-tokens", "4096"]
BURST = 6
PROMPT = list(range(3, 20))
# A client that opens one long handoff from prefill at argv[1], says "open", then reads on;
# paused with SIGSTOP, it keeps that stream in flight on the server.
HOLDER = """
import sys, grpc
from common.handoff.binding import new_nonce
from common.handoff.layout import protocol_version
from common.pb.kvhandoff.v1 import handoff_pb2, handoff_pb2_grpc
stub = handoff_pb2_grpc.HandoffServiceStub(grpc.insecure_channel(sys.argv[1]))
info = stub.GetPrefillInfo(handoff_pb2.GetPrefillInfoRequest(), timeout=10)
call = stub.Prefill(handoff_pb2.PrefillRequest(
    request_id="held", token_ids=[3 + i % 90 for i in range(4000)],
    protocol_version=protocol_version(), nonce=new_nonce(),
    model_fingerprint=info.model_fingerprint), timeout=300)
next(call)
print("open", flush=True)
for _ in call:
    pass
"""


def completed(service) -> int:
    return service.stats().counters.get("handoffs_completed", 0)


def test_two_prefills_share_work_and_losing_one_retries_its_requests(tmp_path):
    a = start_service("prefill", tmp_path / "a", FLAGS)
    services = [a]
    paused = False
    try:
        b = start_service("prefill", tmp_path / "b", FLAGS)
        services.append(b)
        target = f"ipv4:{a.address},{b.address}"
        decode = start_service("decode", tmp_path / "decode", [*FLAGS, "--prefill", target])
        services.append(decode)

        for _ in range(20):  # by load, idle replicas taking turns: both get work
            generate_reply(decode.address, PROMPT, 2)
            if completed(a) > 0 and completed(b) > 0:
                break
        assert completed(a) > 0 and completed(b) > 0, (completed(a), completed(b))

        os.kill(a.proc.pid, signal.SIGSTOP)
        paused = True
        b_before = completed(b)
        outcomes: list = []
        lock = threading.Lock()

        def one() -> None:
            try:
                outcome = generate_reply(decode.address, PROMPT, 3)
            except grpc.RpcError as err:
                outcome = err
            with lock:
                outcomes.append(outcome)

        threads = [threading.Thread(target=one) for _ in range(BURST)]
        for thread in threads:
            thread.start()
        # Settle: everything B was given has finished, and the rest wait inside A.
        deadline, stable = time.monotonic() + 120, 0
        while stable < 10:
            assert time.monotonic() < deadline, "the burst never settled"
            with lock:
                done = len(outcomes)
            stable = stable + 1 if done == completed(b) - b_before and done < BURST else 0
            time.sleep(0.05)
        held_by_a = BURST - done
        retried_before = decode.stats().counters.get("handoff_retried_transport", 0)
        os.kill(a.proc.pid, signal.SIGKILL)
        paused = False
        a.proc.wait(timeout=30)
        for thread in threads:
            thread.join(timeout=120)
        failures = [o for o in outcomes if isinstance(o, grpc.RpcError)]
        successes = [o for o in outcomes if not isinstance(o, grpc.RpcError)]
        assert len(outcomes) == BURST
        assert held_by_a >= 1 and failures == [], (held_by_a, failures)
        assert len(successes) == completed(b) - b_before  # every success came from B
        retried = decode.stats().counters.get("handoff_retried_transport", 0) - retried_before
        assert retried == held_by_a
        assert all(s.completion_tokens == 3 for s in successes)

        b_before = completed(b)
        for _ in range(4):  # new requests go to the survivor and succeed
            assert generate_reply(decode.address, PROMPT, 2).completion_tokens == 2
        assert completed(b) - b_before == 4
        for service in (decode, b):
            wait_until(lambda s=service: (p := s.stats().pool).pages_free == p.pages_total, 10,
                       lambda s=service: f"{s.role} pool back at baseline: {s.stats().pool}")
    finally:
        if paused:
            os.kill(a.proc.pid, signal.SIGCONT)
        for service in reversed(services):
            service.stop()


def test_a_draining_prefill_gets_no_new_handoffs(tmp_path):
    """Replica A drains (SIGTERM) while a paused client holds one of its streams; decode's
    round_robin must skip it (health NOT_SERVING) so new requests all land on B. Needs decode's
    channel to watch replica health (healthCheckConfig in the service config)."""
    a = start_service("prefill", tmp_path / "a", [*FLAGS, "--grace-seconds", "120"])
    services = [a]
    holder = None
    try:
        b = start_service("prefill", tmp_path / "b", FLAGS)
        services.append(b)
        decode = start_service("decode", tmp_path / "decode",
                               [*FLAGS, "--prefill", f"ipv4:{a.address},{b.address}"])
        services.append(decode)
        # A stream that A cannot finish: a long prompt's KV sent to a client that is paused.
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, a.address], cwd=REPO,
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "open"
        os.kill(holder.pid, signal.SIGSTOP)
        a.proc.send_signal(signal.SIGTERM)
        def a_not_serving() -> bool:
            assert a.proc.poll() is None, "A exited while draining"
            return check(a.address, timeout=5) == "NOT_SERVING"

        wait_until(a_not_serving, 60, "A reports NOT_SERVING")
        time.sleep(1.0)  # the health Watch reaches decode's channel; not a measured time
        outcomes = []
        for _ in range(8):
            try:
                outcomes.append(generate_reply(decode.address, PROMPT, 2).completion_tokens)
            except grpc.RpcError as err:
                outcomes.append(f"{err.code().name}: {err.details()}")
        assert a.proc.poll() is None, "A stopped draining early; the test proves nothing"
        assert outcomes == [2] * 8, outcomes
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        for service in reversed(services):
            service.stop()
