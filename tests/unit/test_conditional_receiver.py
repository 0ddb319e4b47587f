"""ConditionalReceiver's choice and DecodeEngine.is_idle, without services: which receiver a
request goes to, the plane its record names, and what counts as busy."""

from __future__ import annotations

import asyncio
import io
from types import SimpleNamespace

import pytest

from common.capacity import Capacity
from common.config import DecodeConfig, ServiceConfig
from common.counters import Counters
from common.handoff.transfer import TransferRecord
from common.log import make_logger
from decode_svc.conditional_prefill import ConditionalPrefillConfig, ConditionalReceiver
from decode_svc.engine import DecodeEngine
from decode_svc.kv_receiver import KvReceiver, LandedKv
from decode_svc.server import conditional_prefill
from common.pb.kvhandoff.v1 import handoff_pb2


class _Remote(KvReceiver):
    def __init__(self) -> None:
        self.plane = "inline"  # negotiated later, as NegotiatedReceiver's is
        self.calls = 0
        self.release: asyncio.Event | None = None  # set: each handoff waits for it

    async def receive(self, job, record) -> LandedKv:
        self.calls += 1
        if self.release is not None:
            await self.release.wait()
        return LandedKv(5, 10, bound=True)


class _Local:
    plane = "local"

    def __init__(self) -> None:
        self.calls = 0

    async def receive(self, job, record) -> LandedKv:
        self.calls += 1
        return LandedKv(7, 0, bound=True, own_kv=True)


class _Engine:
    def __init__(self, idle: bool) -> None:
        self.idle = idle
        self.asked: list[set[str]] = []

    def is_idle(self, landing) -> bool:
        self.asked.append(set(landing))
        return self.idle and not landing


class _Job:
    def __init__(self, n: int, request_id: str = "r") -> None:
        self.request = handoff_pb2.PrefillRequest(request_id=request_id,
                                                  token_ids=list(range(3, 3 + n)))


def _receiver(idle: bool, max_tokens: int = 8, max_kept_tokens: int = 0):
    remote, counters = _Remote(), Counters()
    receiver = ConditionalReceiver(ConditionalPrefillConfig(max_tokens, max_kept_tokens),
                                   _Engine(idle), remote, counters)
    receiver.local = _Local()
    return receiver, remote, counters


@pytest.mark.parametrize("tokens, idle, local", [(1, True, True), (8, True, True),
                                                 (9, True, False), (1, False, False)])
def test_only_a_short_prompt_at_an_idle_engine_stays(tokens, idle, local):
    receiver, remote, counters = _receiver(idle)
    record = TransferRecord("r", receiver.plane)
    landed = asyncio.run(receiver.receive(_Job(tokens), record))
    assert landed.own_kv is local
    assert (receiver.local.calls, remote.calls) == ((1, 0) if local else (0, 1))
    assert counters.snapshot().get("prefills_kept_local", 0) == int(local)
    assert record.plane == ("local" if local else "inline")


def test_the_plane_is_the_remote_chains_now_not_at_start():
    receiver, remote, _ = _receiver(True)
    remote.plane = "shared_memory"  # the handshake agreed on it after start-up
    assert receiver.plane == "shared_memory"


def test_zero_keeps_nothing():
    assert not ConditionalPrefillConfig(0).enabled and ConditionalPrefillConfig(1).enabled


def test_is_idle_counts_every_kind_of_work():
    engine = DecodeEngine(None, None, 8, 8, make_logger("decode", stream=io.StringIO()),
                          Counters())
    assert engine.is_idle(set())
    engine._awaiting_kv.update({"r", "other"})
    assert engine.is_idle(set())  # reserved, their KV not asked of anyone yet
    assert engine.is_idle({"elsewhere"})
    assert not engine.is_idle({"other"})  # a handoff lands
    engine._awaiting_kv.clear()
    engine._joining.add("other")
    assert not engine.is_idle(set())  # checked, not yet begun
    engine._joining.clear()
    engine._running["other"] = object()
    assert not engine.is_idle(set())
    engine._running.clear()
    engine._waiting.append(object())
    assert not engine.is_idle(set())  # waits for pages


class _SlowLocal(_Local):
    """A local prefill that finishes only when the test lets it (or fails, when told to)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.fail = False

    async def receive(self, job, record) -> LandedKv:
        self.calls += 1
        await self.release.wait()
        if self.fail:
            raise RuntimeError("injected")
        return LandedKv(7, 0, bound=True, own_kv=True)


@pytest.mark.parametrize("max_kept, stays", [(0, [True, False, False]),
                                             (12, [True, True, False]),
                                             (18, [True, True, True])])
def test_a_burst_stays_while_its_prompts_fit_one_pass(max_kept, stays):
    async def burst():
        receiver, remote, _ = _receiver(True, max_tokens=8, max_kept_tokens=max_kept)
        receiver.local = _SlowLocal()
        jobs = [_Job(6, f"r{i}") for i in range(3)]
        calls = [asyncio.ensure_future(receiver.receive(job, TransferRecord(job.request.request_id,
                                                                            receiver.plane)))
                 for job in jobs]
        await asyncio.sleep(0)  # every call has chosen: the local ones wait in the engine
        asked = list(receiver.engine.asked)
        receiver.local.release.set()
        landed = await asyncio.gather(*calls)
        return [x.own_kv for x in landed], asked, receiver

    kept, asked, receiver = asyncio.run(burst())
    assert kept == stays
    # each prompt within the budget asks, with no handoff landing; one past it does not ask
    assert asked == [set()] * sum(stays)
    assert receiver._kept == {}


def test_a_short_prompt_while_a_handoff_lands_goes_to_prefill():
    async def behind():
        receiver, remote, _ = _receiver(True, max_tokens=8, max_kept_tokens=64)
        remote.release = asyncio.Event()
        long_call = asyncio.ensure_future(receiver.receive(_Job(20, "long"),
                                                           TransferRecord("long", "inline")))
        await asyncio.sleep(0)
        short_call = asyncio.ensure_future(receiver.receive(_Job(4, "short"),
                                                            TransferRecord("short", "inline")))
        await asyncio.sleep(0)
        remote.release.set()
        landed = await asyncio.gather(long_call, short_call)
        return [x.own_kv for x in landed], receiver

    kept, receiver = asyncio.run(behind())
    assert kept == [False, False]
    assert receiver.engine.asked == [{"long"}]  # the long one never asks: too long
    assert receiver._landing == set()


def test_a_failed_local_prefill_is_no_longer_kept():
    async def fail():
        receiver, _, _ = _receiver(True, max_tokens=8, max_kept_tokens=16)
        receiver.local = _SlowLocal()
        receiver.local.fail = True
        receiver.local.release.set()
        with pytest.raises(RuntimeError):
            await receiver.receive(_Job(6, "r0"), TransferRecord("r0", receiver.plane))
        return receiver

    assert asyncio.run(fail())._kept == {}


@pytest.mark.parametrize("burst, kept", [(0, 256), (512, 512), (100000, 1024)])
def test_a_bursts_share_is_the_threshold_unless_given_and_at_most_one_pass(burst, kept):
    capacity = Capacity(page_size=16, num_pages=64, kv_bytes_per_token=64, context_window=4096,
                        sized_by="pool_tokens")  # 1024 tokens of pool bound decode's pass
    config = DecodeConfig(ServiceConfig(), local_prefill_max_tokens=256,
                          local_prefill_burst_tokens=burst)
    chosen = conditional_prefill(config, SimpleNamespace(capacity=capacity))
    assert (chosen.max_tokens, chosen.max_kept_tokens, chosen.queue_depth) == (256, kept, 0)


def _depth_receiver(queue_depth: int, longest: int = 64):
    remote, counters = _Remote(), Counters()
    remote.release = asyncio.Event()  # handoffs to prefill stay landing until set
    config = ConditionalPrefillConfig(0, queue_depth=queue_depth, chunk_tokens=4,
                                      longest_tokens=longest)
    receiver = ConditionalReceiver(config, _Engine(False), remote, counters)
    receiver.local, receiver.local_chunked = _Local(), _SlowLocal()
    return receiver, remote, counters


def _send(receiver, n: int, request_id: str):
    return asyncio.ensure_future(
        receiver.receive(_Job(n, request_id), TransferRecord(request_id, receiver.plane)))


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_with_depth_prompts_at_prefill_decode_takes_the_next_in_chunks_one_at_a_time(depth):
    async def run():
        receiver, remote, counters = _depth_receiver(depth)
        landing = [_send(receiver, 40, f"p{i}") for i in range(depth)]
        await asyncio.sleep(0)
        assert remote.calls == depth and receiver._landing == {f"p{i}" for i in range(depth)}
        taken = _send(receiver, 40, "taken")
        await asyncio.sleep(0)
        assert receiver.local_chunked.calls == 1 and receiver._taken == {"taken": 40}
        after = _send(receiver, 40, "after")  # one taken prompt at a time: this one queues
        await asyncio.sleep(0)
        assert (remote.calls, receiver.local_chunked.calls) == (depth + 1, 1)
        receiver.local_chunked.release.set()
        remote.release.set()
        results = await asyncio.gather(*landing, taken, after)
        assert [r.own_kv for r in results] == [False] * depth + [True, False]
        assert counters.snapshot()["prefills_taken_from_queue"] == 1
        assert receiver._taken == {} and receiver._landing == set()
        return results

    asyncio.run(run())


@pytest.mark.parametrize("depth, tokens", [(0, 40), (2, 65)])
def test_no_depth_or_a_prompt_decode_cannot_prefill_goes_to_prefill(depth, tokens):
    async def run():
        receiver, remote, counters = _depth_receiver(depth)
        landing = [_send(receiver, 40, f"p{i}") for i in range(2)]
        await asyncio.sleep(0)
        other = _send(receiver, tokens, "other")
        await asyncio.sleep(0)
        assert (remote.calls, receiver.local_chunked.calls) == (3, 0)
        remote.release.set()
        await asyncio.gather(*landing, other)
        assert "prefills_taken_from_queue" not in counters.snapshot()

    asyncio.run(run())


def test_the_queue_depth_rule_is_refused_beside_local_prefill_and_chunks_fit_a_pass():
    capacity = Capacity(page_size=16, num_pages=64, kv_bytes_per_token=64, context_window=4096,
                        sized_by="pool_tokens")
    config = DecodeConfig(ServiceConfig(), local_prefill_queue_depth=2,
                          local_prefill_chunk_tokens=100000)
    chosen = conditional_prefill(config, SimpleNamespace(capacity=capacity))
    assert chosen.enabled and (chosen.max_tokens, chosen.queue_depth) == (0, 2)
    assert chosen.chunk_tokens == chosen.longest_tokens == 1024
    with pytest.raises(ValueError, match="--local-prefill-queue-depth with --local-prefill"):
        conditional_prefill(DecodeConfig(ServiceConfig(), local_prefill=True,
                                         local_prefill_queue_depth=2),
                            SimpleNamespace(capacity=capacity))
