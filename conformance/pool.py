"""A peer's KV pool as its StatsService reports it, and waiting for it to return to baseline."""

from __future__ import annotations

import asyncio
import time

import grpc

from common.pb.kvhandoff.v1 import common_pb2, stats_pb2, stats_pb2_grpc


class PoolWatch:
    """Reads pages_total/pages_free of one peer; `baseline` is the idle reading taken first."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = stats_pb2_grpc.StatsServiceStub(channel)
        self.baseline: common_pb2.PoolStats | None = None

    async def read(self) -> stats_pb2.GetStatsResponse:
        return await self._stub.GetStats(stats_pb2.GetStatsRequest(), timeout=10)

    async def take_baseline(self) -> common_pb2.PoolStats:
        self.baseline = (await self.read()).pool
        return self.baseline

    async def settled(self, timeout: float) -> str | None:
        """Waits until pages_free is back at the baseline; returns a problem or None."""
        assert self.baseline is not None, "take_baseline first"
        deadline = time.monotonic() + timeout
        while True:
            pool = (await self.read()).pool
            if (pool.pages_free == self.baseline.pages_free
                    and pool.pages_total == self.baseline.pages_total):
                return None
            if time.monotonic() > deadline:
                return (f"pool not back at baseline after {timeout:.0f}s: "
                        f"{pool.pages_free}/{pool.pages_total} pages free, baseline "
                        f"{self.baseline.pages_free}/{self.baseline.pages_total}")
            await asyncio.sleep(0.05)
