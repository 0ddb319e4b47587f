"""Continuous batching in decode: with a pool too small for all of them at once, concurrent
requests wait for pages, join the running batch, and each generates exactly what it generates
alone; a full admission queue refuses with RESOURCE_EXHAUSTED / ADMISSION_QUEUE_FULL; the pools
end at their baseline."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.errors import error_reason
from common.pb.kvhandoff.v1 import generate_pb2, generate_pb2_grpc
from tests.helpers.cluster import generate, start_cluster
from tests.helpers.polling import wait_until
from tests.perf.helpers import prompt

pytestmark = pytest.mark.slow

PAGE = 16


def test_waiting_requests_join_the_batch_and_match_solo_runs(tmp_path):
    pool_tokens = 256  # 16 pages; each request below needs 4 to 7 of them
    cluster = start_cluster(tmp_path, "demo", common_flags=[
        "--page-size", str(PAGE), "--max-context-tokens", "256", "--poison-freed-pages",
        "--check-page-owners"], decode_flags=["--pool-tokens", str(pool_tokens)],
        prefill_flags=["--pool-tokens", "4096"])
    try:
        prompts = [prompt(20 + 4 * i, seed=i) for i in range(12)]
        max_tokens = 40
        reserved = sum(len(p) + max_tokens - 1 for p in prompts)
        assert reserved > 2 * pool_tokens  # they cannot all hold pages at once

        def run(ids: list[int]) -> list[int]:
            return generate(cluster.address, token_ids=ids, max_tokens=max_tokens,
                            ignore_eos=True).token_ids

        solo = [run(p) for p in prompts]
        cluster.assert_pools_at_baseline()
        steps_before = cluster.decode.stats().counters["decode_steps"]
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            together = list(pool.map(run, prompts))
        assert together == solo
        assert all(len(tokens) == max_tokens for tokens in together)
        steps = cluster.decode.stats().counters["decode_steps"] - steps_before
        assert steps < len(prompts) * (max_tokens - 1)  # some steps advanced several requests
        cluster.assert_pools_at_baseline()
    finally:
        cluster.stop()


def test_full_admission_queue_is_refused(tmp_path):
    cluster = start_cluster(tmp_path, "demo", common_flags=[
        "--page-size", str(PAGE), "--pool-tokens", "4096", "--max-context-tokens", "4096"],
        decode_flags=["--max-waiting", "1"])
    try:
        small = prompt(5, seed=1)
        expected_small = generate(cluster.address, token_ids=small, max_tokens=8,
                                  ignore_eos=True).token_ids
        with grpc.insecure_channel(cluster.address) as channel:
            stub = generate_pb2_grpc.GenerationServiceStub(channel)
            # holds the whole decode pool (4095 slots) while it generates
            hog = stub.Generate(generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=[7]), max_tokens=4095, ignore_eos=True))
            assert next(hog).HasField("token")
            with ThreadPoolExecutor(max_workers=1) as pool:
                waiter = pool.submit(generate, cluster.address, token_ids=small, max_tokens=8,
                                     ignore_eos=True)
                wait_until(lambda: cluster.decode.stats().pool.waiting_requests == 1, 60,
                           "the second request waits for pages")
                with pytest.raises(grpc.RpcError) as refused:
                    generate(cluster.address, token_ids=prompt(6, seed=2), max_tokens=8)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert error_reason(refused.value) == "ADMISSION_QUEUE_FULL"
                hog.cancel()  # frees the pool: the waiting request is admitted and completes
                assert waiter.result(timeout=120).token_ids == expected_small
        cluster.assert_pools_at_baseline()
    finally:
        cluster.stop()
