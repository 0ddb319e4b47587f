"""Prefill never hands off a rejected request: boundaries at the pool (capacity - 1, capacity,
capacity + 1), the window + 1, and with the pool partly used by other requests. Accepted
requests carry exactly the KV the model computes; rejected ones get a REJECTED header, a gRPC
error, no chunk and no forward pass."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from common.handoff.binding import new_nonce
from common.handoff.codec import bytes_to_kv
from common.handoff.layout import KvLayout, protocol_version
from common.kvpool.kv_cache import KvPool, PoolConfig
from common.model.llama import LlamaModel, PrefillBatch
from common.model.loader import load_model
from common.ops.select import make_ops
from common.pb.kvhandoff.v1 import handoff_pb2
from tests.helpers.cluster import handoff_stub, start_service

pytestmark = pytest.mark.slow
PAGE, POOL, WINDOW = 16, 64, 128


@pytest.fixture(scope="module")
def prefill(tmp_path_factory):
    service = start_service("prefill", tmp_path_factory.mktemp("bounds"), [
        "--model", "demo", "--page-size", str(PAGE), "--pool-tokens", str(POOL),
        "--max-context-tokens", str(WINDOW), "--allow-context-beyond-pool",
        "--poison-freed-pages", "--check-page-owners"])
    yield service
    service.stop()


@pytest.fixture(scope="module")
def reference():
    """The demo model in-process on the ops the service picks (--kernels auto on the CPU): the
    KV an accepted prompt must carry, bit for bit. (Backends agree with the torch reference
    within a tolerance, tested in tests/kernels; this test is about which KV, not numerics.)"""
    loaded = load_model("demo")
    ops = make_ops("auto", torch.device("cpu"))
    model = LlamaModel(loaded.config, loaded.weights, ops, torch.device("cpu"), torch.float32)
    c = loaded.config
    layout = KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32)

    def kv_of(prompt: list[int]) -> list[torch.Tensor]:
        n = len(prompt)
        pool = KvPool(PoolConfig(pool_tokens=WINDOW, page_size=PAGE), c.num_layers,
                      c.num_kv_heads, c.head_dim, torch.float32, torch.device("cpu"))
        pages = pool.allocator.allocate("ref", n)
        batch = PrefillBatch(torch.tensor(prompt), torch.arange(n),
                             torch.tensor(pool.slots_for(pages, 0, n)),
                             torch.tensor([0, n], dtype=torch.int32), n)
        model.prefill(batch, pool.k, pool.v)
        table = torch.tensor(pages, dtype=torch.int32)
        return [ops.pack_kv(pool.k[layer], pool.v[layer], table, 0, n)
                for layer in range(c.num_layers)]

    return layout, kv_of


def _handoff(address: str, request_id: str, prompt: list[int]):
    """-> (frames, grpc error or None)."""
    request = handoff_pb2.PrefillRequest(request_id=request_id, token_ids=prompt,
                                         protocol_version=protocol_version(), nonce=new_nonce())
    frames = []
    with grpc.insecure_channel(address) as channel:
        try:
            for frame in handoff_stub(channel).Prefill(request, timeout=60):
                frames.append(frame)
        except grpc.RpcError as err:
            return frames, err
    return frames, None


def _assert_kv_exact(frames, prompt, reference) -> None:
    layout, kv_of = reference
    expected = kv_of(prompt)
    assert frames[0].header.status == handoff_pb2.HANDOFF_STATUS_OK
    assert frames[0].header.token_count == len(prompt)
    got = [torch.full_like(e, float("nan")) for e in expected]
    for frame in frames[1:-1]:
        c = frame.chunk
        got[c.layer][:, c.token_start:c.token_end] = bytes_to_kv(layout, c.k, c.v,
                                                               c.token_end - c.token_start)
    for layer, (g, e) in enumerate(zip(got, expected)):
        assert torch.equal(g, e), f"layer {layer} KV differs"
    commit = frames[-1].commit
    assert commit.status == handoff_pb2.HANDOFF_STATUS_OK
    assert commit.chunk_count == len(frames) - 2


def _forward_passes(service) -> int:
    return service.stats().counters.get("forward_passes", 0)


@pytest.mark.parametrize("n", [POOL - 1, POOL])
def test_prompts_up_to_the_pool_carry_exact_kv(prefill, reference, n):
    prompt = [(7 * i) % 90 + 2 for i in range(n)]
    frames, err = _handoff(prefill.address, f"fits-{n}", prompt)
    assert err is None
    _assert_kv_exact(frames, prompt, reference)


@pytest.mark.parametrize("n, code, reason", [
    (POOL + 1, grpc.StatusCode.RESOURCE_EXHAUSTED, "POOL_TOO_SMALL"),
    (WINDOW + 1, grpc.StatusCode.INVALID_ARGUMENT, "PROMPT_TOO_LONG"),
])
def test_prompts_past_a_limit_get_no_kv(prefill, n, code, reason):
    before = _forward_passes(prefill)
    frames, err = _handoff(prefill.address, f"over-{n}", [5] * n)
    assert err is not None and err.code() == code
    assert [f.WhichOneof("frame") for f in frames] == ["header"]
    assert frames[0].header.status == handoff_pb2.HANDOFF_STATUS_REJECTED
    assert frames[0].header.reason_code == reason
    assert _forward_passes(prefill) == before
    pool = prefill.stats().pool
    assert pool.pages_free == pool.pages_total


def test_a_partly_used_pool_queues_what_fits_and_still_rejects_what_never_fits(prefill, reference):
    """Requests that fit the whole pool wait for pages held by others; one that can never fit
    is rejected at once, however busy the pool is."""
    prompts = {f"busy-{i}": [(11 * i + 3 * j) % 90 + 2 for j in range(40 + i)] for i in range(4)}
    with ThreadPoolExecutor(max_workers=5) as pool:
        futures = {rid: pool.submit(_handoff, prefill.address, rid, p)
                   for rid, p in prompts.items()}
        over = pool.submit(_handoff, prefill.address, "never-fits", [5] * (POOL + 1))
        results = {rid: f.result() for rid, f in futures.items()}
        over_frames, over_err = over.result()
    for rid, (frames, err) in results.items():
        assert err is None, (rid, err)
        assert {f.header.request_id for f in frames[:1]} | {
            f.chunk.request_id for f in frames[1:-1]} | {frames[-1].commit.request_id} == {rid}
        _assert_kv_exact(frames, prompts[rid], reference)
    assert over_err is not None and over_err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert [f.WhichOneof("frame") for f in over_frames] == ["header"]
    pool_stats = prefill.stats().pool
    assert pool_stats.pages_free == pool_stats.pages_total

