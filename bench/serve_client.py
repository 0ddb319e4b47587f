"""The load generator of `kvhandoff bench serve`: requests drawn from length distributions, sent
at a Poisson rate (or all at once) under an optional concurrency cap, each timed per token, to
our gRPC API (GrpcBackend) or an OpenAI-compatible server (bench.openai_client) by the same
timing code."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field

import grpc

from bench.errors import BenchRequestFailed
from common.errors import error_reason
from common.pb.kvhandoff.v1 import generate_pb2, generate_pb2_grpc


@dataclass(frozen=True)
class LengthRange:
    """A fixed length (low == high) or a uniform integer range [low, high]."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """'256' or '128:512'."""
        parts = [int(p) for p in text.split(":")]
        if len(parts) not in (1, 2) or min(parts) < 1 or parts[0] > parts[-1]:
            raise ValueError(f"length {text!r}: use N or LOW:HIGH with 1 <= LOW <= HIGH")
        return cls(parts[0], parts[-1])

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True)
class RequestSpec:
    token_ids: list[int]
    max_tokens: int
    cache_salt: str = ""


@dataclass
class RequestResult:
    """Times in seconds from the request's send; token_times are the arrivals of each token."""

    prompt_len: int
    max_tokens: int
    sent_at: float = 0.0
    token_times: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.token_times)

    @property
    def output_len(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with a single token."""
        if self.output_len < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.output_len - 1)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def record(self) -> dict:
        return {**asdict(self), "output_len": self.output_len}


def make_requests(count: int, input_len: LengthRange, output_len: LengthRange, vocab_size: int,
                  seed: int, shared_prefix_len: int = 0, cache_salt: str = ""
                  ) -> list[RequestSpec]:
    """Random prompts; with shared_prefix_len, every prompt starts with the same
    shared_prefix_len tokens (a system prompt) followed by its own input_len tokens."""
    rng = random.Random(seed)
    low_id = min(3, vocab_size - 1)
    prefix = [rng.randrange(low_id, vocab_size) for _ in range(shared_prefix_len)]
    return [RequestSpec(prefix + [rng.randrange(low_id, vocab_size)
                                  for _ in range(input_len.draw(rng))],
                        output_len.draw(rng), cache_salt) for _ in range(count)]


Send = Callable[["RequestSpec", float], Awaitable["RequestResult"]]


async def run_one(stub: generate_pb2_grpc.GenerationServiceStub, spec: RequestSpec,
                  timeout: float) -> RequestResult:
    """One streamed generation; generation past stop ids is forced (ignore_eos) so that the
    output length is the one asked for."""
    result = RequestResult(len(spec.token_ids), spec.max_tokens)
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=spec.token_ids), max_tokens=spec.max_tokens,
        ignore_eos=True, cache_salt=spec.cache_salt)
    started = time.perf_counter()
    result.sent_at = started
    try:
        async for response in stub.Generate(request, timeout=timeout):
            if response.HasField("token"):
                result.token_times.append(time.perf_counter() - started)
    except grpc.aio.AioRpcError as err:
        result.error = f"{err.code().name} {error_reason(err) or ''}: {err.details()}"
    result.latency = time.perf_counter() - started
    return result


class GrpcBackend:
    """Our decode's gRPC Generate API at `address`; `connect()` opens one channel for a load."""

    label = "grpc"

    def __init__(self, address: str) -> None:
        self.address = address

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[Send]:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = generate_pb2_grpc.GenerationServiceStub(channel)
            yield lambda spec, timeout: run_one(stub, spec, timeout)


async def run_load(backend, specs: list[RequestSpec], request_rate: float,
                   max_concurrency: int, seed: int, timeout: float,
                   progress: Callable[[int, int], None]) -> tuple[list[RequestResult], float]:
    """Sends every spec through `backend` (GrpcBackend, or bench.openai_client.OpenAiBackend:
    anything whose connect() yields send(spec, timeout) -> RequestResult), Poisson arrivals at
    request_rate (math.inf: all at once), at most max_concurrency in flight (0: no cap).
    Returns the results and the run's duration."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
    done = 0

    async def one(send: Send, spec: RequestSpec) -> RequestResult:
        nonlocal done
        if limit is None:
            result = await send(spec, timeout)
        else:
            async with limit:
                result = await send(spec, timeout)
        done += 1
        progress(done, len(specs))
        return result

    async with backend.connect() as send:
        started = time.perf_counter()
        tasks = []
        for i, spec in enumerate(specs):
            tasks.append(asyncio.ensure_future(one(send, spec)))
            if math.isfinite(request_rate) and i + 1 < len(specs):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    for result in results:
        result.sent_at -= started
    return list(results), duration


async def warm_up(backend, specs: list[RequestSpec], timeout: float) -> None:
    """Runs the warm-up requests one after another; their times are not recorded."""
    async with backend.connect() as send:
        for spec in specs:
            result = await send(spec, timeout)
            if result.error:
                raise BenchRequestFailed(f"warm-up request failed: {result.error}")
