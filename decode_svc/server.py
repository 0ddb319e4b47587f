"""Starts the decode service: the client-facing front door, after its handshake with prefill."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.config import DecodeConfig
from common.log import make_logger
from common.metrics import ServiceMetrics
from common.pb.kvhandoff.v1 import generate_pb2, generate_pb2_grpc, stats_pb2, stats_pb2_grpc
from common.server.auth import BearerTokenInterceptor
from common.server.grpc_server import (TlsFiles, create_server, run_async, serve_until_signalled,
                                       set_serving)
from common.server.runtime import Runtime, build_runtime, warm_up
from common.server.stats import StatsServicer
from decode_svc.engine import DecodeEngine
from decode_svc.prefill_client import PrefillClient
from decode_svc.servicer import DecodeState, GenerationServicer
from decode_svc.validation import DecodeLimits

SERVICE_NAMES = [generate_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name,
                 stats_pb2.DESCRIPTOR.services_by_name["StatsService"].full_name]


@dataclass
class RunningDecode:
    server: grpc.aio.Server
    port: int
    health: object
    engine: DecodeEngine
    client: PrefillClient
    handshake: asyncio.Task
    metrics_port: int


async def handshake(config: DecodeConfig, runtime: Runtime, client: PrefillClient,
                    state: DecodeState, health, log) -> None:
    """Asks prefill for its model, layout and limits until it answers; agrees or refuses."""
    while True:
        try:
            info = await client.info(timeout=10.0)
            break
        except grpc.aio.AioRpcError as err:
            log.warning("prefill_unreachable", target=client.target, code=err.code().name)
            await asyncio.sleep(1.0)
    mine = runtime.loaded.fingerprint
    if info.model_fingerprint != mine or not runtime.layout.matches(info.layout):
        state.refusing = (f"prefill at {client.target} serves model {info.model_fingerprint} "
                          f"with layout {info.layout}, this decode serves {mine} with "
                          f"{runtime.layout.to_proto()}; refusing all requests")
        log.error("prefill_mismatch", message=state.refusing)
        return
    capacity = runtime.capacity
    state.limits = DecodeLimits(
        vocab_size=runtime.loaded.config.vocab_size,
        context_window=min(capacity.context_window, int(info.max_context_tokens)),
        own_pool_tokens=capacity.pool_tokens,
        prefill_max_prompt=min(capacity.max_prompt_tokens, int(info.max_prompt_tokens)),
        default_max_tokens=config.default_max_tokens)
    log.info("prefill_agreed", target=client.target, prefill_max_prompt=info.max_prompt_tokens,
             effective_max_prompt=state.limits.prefill_max_prompt,
             context_window=state.limits.context_window)
    await set_serving(health, SERVICE_NAMES, True)


async def start_decode(config: DecodeConfig) -> RunningDecode:
    svc = config.service
    log = make_logger("decode")
    runtime = build_runtime(svc, log)
    refusals: dict[str, int] = {}
    counters: dict[str, int] = {}
    engine = DecodeEngine(runtime.model, runtime.pool, config.max_batch, config.max_waiting,
                          log, counters)
    peer_tls = TlsFiles(svc.tls_cert, svc.tls_key, svc.tls_ca) if svc.tls_cert else None
    client = PrefillClient(config.prefill_target, config.max_chunk_bytes, peer_tls)
    state = DecodeState()
    allocator = runtime.pool.allocator
    metrics = ServiceMetrics("decode", lambda: allocator.num_pages,
                             lambda: allocator.snapshot().pages_free, engine.running_count,
                             engine.waiting_count)
    generation = GenerationServicer(
        engine, client, state, runtime.layout, runtime.loaded.fingerprint,
        runtime.loaded.tokenizer, runtime.loaded.config.eos_token_ids, config.max_chunk_bytes,
        config.handoff_timeout_s, refusals, metrics, log)
    stats = StatsServicer(
        "decode", allocator, runtime.capacity,
        lambda: state.limits.prefill_max_prompt if state.limits else 0, refusals, counters,
        engine.running_count, engine.waiting_count)

    def register(server: grpc.aio.Server) -> list[str]:
        generate_pb2_grpc.add_GenerationServiceServicer_to_server(generation, server)
        stats_pb2_grpc.add_StatsServiceServicer_to_server(stats, server)
        return SERVICE_NAMES

    interceptors = [BearerTokenInterceptor(config.api_token)] if config.api_token else []
    api_tls = TlsFiles(config.api_tls_cert, config.api_tls_key) if config.api_tls_cert else None
    server, port, health = await create_server(register, svc.host, svc.port, api_tls, 4 << 20,
                                               interceptors)
    metrics_port = metrics.serve_http(svc.host, svc.metrics_port) if svc.metrics_port >= 0 else -1
    warm_up(runtime)
    engine.start()
    task = asyncio.ensure_future(handshake(config, runtime, client, state, health, log))
    log.info("listening", role="decode", address=f"{svc.host}:{port}", metrics_port=metrics_port,
             prefill=config.prefill_target)
    return RunningDecode(server, port, health, engine, client, task, metrics_port)


def serve(config: DecodeConfig, port_file: Path | None = None) -> None:
    async def main() -> None:
        running = await start_decode(config)
        if port_file is not None:
            port_file.write_text(str(running.port))

        async def on_stop() -> None:
            running.handshake.cancel()
            running.engine.stop()
            await running.client.close()

        await serve_until_signalled(running.server, running.health, SERVICE_NAMES,
                                    config.service.grace_seconds, on_stop)

    run_async(main)
