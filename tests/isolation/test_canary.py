"""Tenant isolation under page churn: 40 concurrent clients, each prompt carrying a unique canary
token sequence, mixed with over-length, cancelled and corrupted-handoff requests, on pools so
small that every page is reused many times, with chunked prefill on (16-token chunks). Every
completed request's greedy output equals the same request run alone on the idle cluster; every
bad one fails with its own status and sends no token it should not; both pools end at their
baseline.

The prefill runs through tests.isolation.patched_service, which corrupts the crc32c of every
chunk of a prompt whose first token is MARKER (the handoff of that request only)."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest

from common.errors import error_reason
from common.pb.kvhandoff.v1 import generate_pb2, generate_pb2_grpc
from tests.helpers.checkpoints import SPECS, make_checkpoint
from tests.helpers.cluster import Cluster
from tests.isolation.launch import PATCHED, start

pytestmark = pytest.mark.slow

PAGE, WINDOW, PREFILL_POOL, DECODE_POOL = 4, 128, 96, 256
CLIENTS = 40
TENANTS = 4
PREFILL_CHUNK = 16  # chunked prefill on: prompts of up to 128 tokens take up to 8 passes
MARKER = 7
SYSTEM = [11, 12, 13, 14, 15]  # a prefix every tenant shares
VOCAB = SPECS[0].vocab
BOTH = ["--page-size", str(PAGE), "--max-context-tokens", str(WINDOW), "--poison-freed-pages",
        "--check-page-owners"]
C = grpc.StatusCode
BAD = {  # kind -> (status, reason)
    "too_long": (C.INVALID_ARGUMENT, "PROMPT_TOO_LONG"),
    "beyond_prefill_pool": (C.RESOURCE_EXHAUSTED, "POOL_TOO_SMALL"),
    "max_tokens": (C.INVALID_ARGUMENT, "MAX_TOKENS_TOO_LARGE"),
    "corrupt": (C.DATA_LOSS, "CHECKSUM_MISMATCH"),
    "cancel": (C.CANCELLED, None),
}
MIDDLE = ["too_long", "beyond_prefill_pool", "max_tokens", "corrupt", "cancel", "cancel",
          "corrupt", "complete"]


@dataclass(frozen=True)
class Job:
    kind: str
    prompt: tuple[int, ...]
    max_tokens: int
    cancel_after: int = 0
    salt: str = ""


@dataclass(frozen=True)
class Result:
    tokens: list[int]
    code: grpc.StatusCode
    reason: str | None
    finish_reason: int = 0
    cancel_accepted: bool = False


def _plan(seed: int) -> list[list[Job]]:
    """Per client: a complete request, a bad (or a third complete) one, a complete one."""
    rng = random.Random(seed)
    canaries: set[tuple[int, ...]] = set()

    def tenant_prompt(extra: int) -> list[int]:
        while (canary := tuple(rng.randrange(16, VOCAB) for _ in range(6))) in canaries:
            pass
        canaries.add(canary)
        return SYSTEM + list(canary) + [rng.randrange(3, VOCAB) for _ in range(extra)]

    def job(kind: str) -> Job:
        if kind == "complete":
            return Job(kind, tuple(tenant_prompt(rng.randrange(0, 45))), rng.randrange(2, 25))
        if kind == "cancel":
            prompt = tenant_prompt(rng.randrange(0, 30))
            return Job(kind, tuple(prompt), WINDOW - len(prompt) + 1, rng.randrange(1, 5))
        if kind == "corrupt":
            return Job(kind, tuple([MARKER] + tenant_prompt(rng.randrange(0, 40))), 8)
        if kind == "too_long":
            return Job(kind, tuple(tenant_prompt(WINDOW - 11 + rng.randrange(1, 20))), 4)
        if kind == "beyond_prefill_pool":
            return Job(kind, tuple(tenant_prompt(PREFILL_POOL - 11 + rng.randrange(1, 32))), 1)
        prompt = tenant_prompt(50)  # max_tokens: prompt plus max_tokens passes the window
        return Job(kind, tuple(prompt), WINDOW - len(prompt) + 2 + rng.randrange(0, 40))

    def salted(i: int, job: Job) -> Job:
        return Job(job.kind, job.prompt, job.max_tokens, job.cancel_after,
                   f"tenant-{i % TENANTS}")

    return [[salted(i, job("complete")), salted(i, job(MIDDLE[i % len(MIDDLE)])),
             salted(i, job("complete"))] for i in range(CLIENTS)]


def _run(channel: grpc.Channel, job: Job) -> Result:
    request = generate_pb2.GenerateRequest(max_tokens=job.max_tokens, ignore_eos=True,
                                           cache_salt=job.salt)
    request.token_ids.ids.extend(job.prompt)
    call = generate_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=300)
    tokens: list[int] = []
    accepted = False
    try:
        for response in call:
            if response.HasField("finished"):
                return Result(tokens, C.OK, None, response.finished.finish_reason)
            tokens.append(response.token.token_id)
            if len(tokens) == job.cancel_after:
                accepted = call.cancel()
    except grpc.RpcError as err:
        return Result(tokens, err.code(), error_reason(err), cancel_accepted=accepted)
    raise AssertionError(f"stream ended without a finished message after {tokens}")


@pytest.fixture(scope="module", params=["--no-prefix-cache", "--prefix-cache"])
def cluster(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("canary")
    path, _ = make_checkpoint(SPECS[0], root)
    prefill = start("prefill", root / "run", [
        "--model", str(path), *BOTH, "--pool-tokens", str(PREFILL_POOL),
        "--allow-context-beyond-pool", "--prefill-chunk-tokens", str(PREFILL_CHUNK),
        request.param], env={"KVH_TEST_CORRUPT_MARKER": str(MARKER)}, module=PATCHED)
    try:
        decode = start("decode", root / "run", [
            "--model", str(path), "--prefill", prefill.address, *BOTH,
            "--pool-tokens", str(DECODE_POOL)])
    except Exception:
        prefill.stop()
        raise
    c = Cluster(prefill, decode)
    c.prefix_cache = request.param == "--prefix-cache"
    yield c
    c.stop()


def test_canaries_stay_with_their_tenant_under_page_churn(cluster):
    plan = _plan(seed=2026)
    jobs = [job for script in plan for job in script]
    assert len({job.prompt for job in jobs}) == len(jobs)
    pages_asked = sum(-(-(len(j.prompt) + j.max_tokens - 1) // PAGE) for j in jobs
                      if j.kind in ("complete", "cancel"))
    assert pages_asked > 10 * (DECODE_POOL // PAGE)  # the design forces heavy page reuse

    # 1. each request alone on the idle cluster: the reference
    with grpc.insecure_channel(cluster.address) as channel:
        alone = {}
        for job in jobs:
            if job.kind in ("complete", "cancel"):
                solo = Job("complete", job.prompt, job.cancel_after or job.max_tokens,
                           salt=job.salt)
                alone[job] = _run(channel, solo)
                assert alone[job].code == C.OK, alone[job]
    cluster.assert_pools_at_baseline()
    steps_before = cluster.decode.stats().counters["decode_steps"]

    # 2. the storm: every client on its own channel, all released at once
    barrier = threading.Barrier(CLIENTS)

    def client(script: list[Job]) -> list[Result]:
        with grpc.insecure_channel(cluster.address) as channel:
            barrier.wait()
            return [_run(channel, job) for job in script]

    with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
        results = [r for script in pool.map(client, plan) for r in script]

    # 3. every completed request equals its solo run; every bad one failed as it should
    generated = 0
    for job, got in zip(jobs, results, strict=True):
        if job.kind == "complete":
            assert got.code == C.OK, (job, got)
            assert got.tokens == alone[job].tokens, f"{job.prompt[:11]} differs from its solo run"
            assert got.finish_reason == generate_pb2.FINISH_REASON_LENGTH
            generated += len(got.tokens) - 1
        elif job.kind == "cancel":
            assert got.cancel_accepted, f"finished before the cancel: {got}"
            assert got.code == C.CANCELLED, (job, got)
            assert got.tokens == alone[job].tokens  # what it saw before cancelling is its own
        else:
            code, reason = BAD[job.kind]
            assert (got.code, got.reason) == (code, reason), (job.kind, got)
            assert got.tokens == [], f"{job.kind} sent tokens before failing"
    assert generated > 0
    counts = {kind: sum(j.kind == kind for j in jobs) for kind in ("complete", *BAD)}
    assert counts["corrupt"] >= 8 and counts["cancel"] >= 8 and counts["complete"] >= 80

    # 4. nothing left behind; the refusals were counted; no ownership check ever fired
    cluster.assert_pools_at_baseline()
    stats = cluster.decode.stats()
    assert stats.pool.running_requests == 0 and stats.pool.waiting_requests == 0
    assert stats.refusals.get("CHECKSUM_MISMATCH", 0) == counts["corrupt"]
    assert stats.counters["decode_steps"] - steps_before < generated  # steps were shared
    log = cluster.decode.log_text()
    for event in ("page_ownership_violation", "decode_step_failed", "engine_command_failed"):
        assert event not in log
    assert "prefill_failed" not in cluster.prefill.log_text()
    counters = cluster.prefill.stats().counters
    if cluster.prefix_cache:  # it was used, and evicted under the churn
        assert counters["prefix_cache_hits"] > CLIENTS
        assert counters["prefix_cache_pages_evicted"] > 0
    else:
        assert counters.get("prefix_cache_hits", 0) == 0
