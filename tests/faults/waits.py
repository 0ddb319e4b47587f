"""Polling helpers for fault tests: read a service's pool through its StatsService until a
condition holds (releases and reconnects are asynchronous), and run a call in a thread."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from common.errors import error_reason
from common.pb.kvhandoff.v1 import generate_pb2, generate_pb2_grpc
from tests.helpers.cluster import Service
from tests.helpers.polling import wait_until


def at_baseline(service: Service) -> bool:
    pool = service.stats().pool
    return pool.pages_free == pool.pages_total and pool.running_requests == 0


def wait_baseline(service: Service, timeout: float = 30.0) -> None:
    wait_until(lambda: at_baseline(service), timeout,
               f"{service.role} pool back at baseline: {service.stats().pool}")


def wait_pages_taken(service: Service, timeout: float = 60.0) -> None:
    """Until some request holds pages (a handoff or a generation is in flight there)."""
    def taken() -> bool:
        pool = service.stats().pool
        return pool.pages_free < pool.pages_total
    wait_until(taken, timeout, f"{service.role} holds pages for a request")


@dataclass
class StreamCall:
    """A Generate stream consumed in a thread: tokens as they come, then the outcome."""

    address: str
    prompt: list[int]
    max_tokens: int
    timeout: float
    tokens: list[int] = field(default_factory=list)
    code: grpc.StatusCode | None = None
    reason: str | None = None
    elapsed: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> StreamCall:
        self._channel = grpc.insecure_channel(self.address)
        request = generate_pb2.GenerateRequest(max_tokens=self.max_tokens, ignore_eos=True)
        request.token_ids.ids.extend(self.prompt)
        self._started = time.monotonic()
        self.call = generate_pb2_grpc.GenerationServiceStub(self._channel).Generate(
            request, timeout=self.timeout)
        threading.Thread(target=self._consume, daemon=True).start()
        return self

    def _consume(self) -> None:
        try:
            for response in self.call:
                if response.HasField("token"):
                    self.tokens.append(response.token.token_id)
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            self.code, self.reason = err.code(), error_reason(err)
        finally:
            self.elapsed = time.monotonic() - self._started
            self._channel.close()
            self.done.set()

    def wait_tokens(self, count: int, timeout: float = 60.0) -> None:
        wait_until(lambda: len(self.tokens) >= count or self.done.is_set(), timeout,
                   f"{count} tokens")
        assert len(self.tokens) >= count, (self.tokens, self.code, self.reason)

    def outcome(self, timeout: float) -> tuple[grpc.StatusCode, str | None]:
        assert self.done.wait(timeout), "the call did not end"
        return self.code, self.reason
