"""Decode's half of the services' handoff in `kvhandoff bench transfer`: a real `PrefillClient`,
`receive_handoff` (verifier, crc32c over decode's copy, the engine's writes into its pool) for
the inline plane, and `SharedMemoryReceiver` for the shared-memory plane. One handoff is timed
from the Prefill call to the last chunk written into decode's pool."""

from __future__ import annotations

import asyncio
import io
import time
import uuid

import torch

from bench.synthetic_prefill import FINGERPRINT, PAGE_SIZE, VOCAB, PoolOnlyModel
from common.counters import Counters
from common.handoff.binding import new_nonce, prompt_digest
from common.handoff.layout import KvLayout, protocol_version
from common.handoff.planes import DEFAULT_SHM_DIR, SHARED_MEMORY
from common.handoff.transfer import TransferRecord
from common.handoff.verifier import Expectation
from common.kvpool.kv_cache import KvPool, PoolConfig
from common.log import make_logger
from common.pb.kvhandoff.v1 import handoff_pb2
from common.sampling import SamplingConfig
from decode_svc.engine import DecodeEngine
from decode_svc.handoff import InlineReceiver
from decode_svc.kv_receiver import HandoffJob
from decode_svc.prefill_client import PrefillClient
from decode_svc.shm_receiver import SharedMemoryReceiver

TWO_PASS = "shared-memory-2pass"  # the shared-memory receiver with its checks as two passes
INLINE_3PASS = "inline-3pass"  # the inline receiver with the engine's write path (no landing)


class DecodeSide:
    """Reservation, the real receive path of each plane, the engine's writes."""

    def __init__(self, layout: KvLayout, pool_tokens: int, address: str,
                 max_chunk_bytes: int) -> None:
        self.layout = layout
        self.max_chunk_bytes = max_chunk_bytes
        pages = -(-pool_tokens // PAGE_SIZE) + 1  # one spare page for the barrier
        self.pool = KvPool(PoolConfig(pool_tokens=pages * PAGE_SIZE, page_size=PAGE_SIZE),
                           layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype,
                           torch.device("cpu"))
        self.engine = DecodeEngine(PoolOnlyModel(layout), self.pool, max_batch=1, max_waiting=4,
                                   log=make_logger("decode", stream=io.StringIO()),
                                   counters=Counters())
        self.client = PrefillClient(address, max_chunk_bytes, None)
        self.receivers = {"inline": InlineReceiver(self.client, self.engine),
                          INLINE_3PASS: InlineReceiver(self.client, self.engine,
                                                       in_place=False),
                          SHARED_MEMORY: SharedMemoryReceiver(self.client, self.engine,
                                                              DEFAULT_SHM_DIR),
                          TWO_PASS: SharedMemoryReceiver(self.client, self.engine,
                                                         DEFAULT_SHM_DIR, one_pass=False)}

    async def _reserve(self, request_id: str, num_tokens: int) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self.engine.reserve(request_id, num_tokens,
                            lambda result: loop.call_soon_threadsafe(done.set_result, result))
        result = await asyncio.wait_for(done, 60.0)
        if not isinstance(result, list):
            raise RuntimeError(f"reservation refused: {result}")

    async def handoff(self, num_tokens: int, plane: str) -> tuple[float, int]:
        """-> (seconds, payload bytes) of one verified handoff written into the pool."""
        request_id = uuid.uuid4().hex
        barrier = f"{request_id}-barrier"
        await self._reserve(request_id, num_tokens)
        request = handoff_pb2.PrefillRequest(
            request_id=request_id, token_ids=[1] * num_tokens,
            protocol_version=protocol_version(), nonce=new_nonce(),
            model_fingerprint=FINGERPRINT, sampling=SamplingConfig().to_proto(),
            max_chunk_bytes=self.max_chunk_bytes)
        expect = Expectation(request_id, num_tokens, self.layout, FINGERPRINT,
                             self.max_chunk_bytes, VOCAB, request.nonce,
                             prompt_digest(request.token_ids))
        try:
            started = time.perf_counter()
            landed = await self.receivers[plane].receive(
                HandoffJob(request, expect, SamplingConfig(), 600.0),
                TransferRecord(request_id, plane))
            await self._reserve(barrier, 1)  # commands run in order: every write is done now
            return time.perf_counter() - started, landed.payload_bytes
        finally:
            self.engine.release(request_id)
            self.engine.release(barrier)

    def start(self) -> None:
        self.engine.start()

    async def close(self) -> None:
        self.engine.stop()
        await self.client.close()
