"""The StatsService both services serve: pool occupancy, limits, refusals and counters."""

from __future__ import annotations

from collections.abc import Callable

from common.capacity import Capacity
from common.counters import Counters
from common.kvpool.allocator import PageAllocator
from common.pb.kvhandoff.v1 import common_pb2, stats_pb2, stats_pb2_grpc


class StatsServicer(stats_pb2_grpc.StatsServiceServicer):
    def __init__(self, role: str, allocator: PageAllocator, capacity: Capacity,
                 max_prompt_tokens: Callable[[], int], refusals: Counters,
                 counters: Counters, running: Callable[[], int],
                 waiting: Callable[[], int]) -> None:
        self.role = role
        self.allocator = allocator
        self.capacity = capacity
        self.max_prompt_tokens = max_prompt_tokens
        self.refusals = refusals
        self.counters = counters
        self.running = running
        self.waiting = waiting

    async def GetStats(self, request, context) -> stats_pb2.GetStatsResponse:
        snap = self.allocator.snapshot()
        pool = common_pb2.PoolStats(
            page_size=snap.page_size, pages_total=snap.pages_total,
            pages_free=snap.pages_available,  # cached pages no request reads count as free
            tokens_total=snap.tokens_total, max_prompt_tokens=self.max_prompt_tokens(),
            max_context_tokens=self.capacity.context_window, running_requests=self.running(),
            waiting_requests=self.waiting())
        return stats_pb2.GetStatsResponse(role=self.role, pool=pool,
                                          refusals=self.refusals.snapshot(),
                                          counters=self.counters.snapshot())
