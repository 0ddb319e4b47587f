"""Starts the prefill service: `create_server(config) -> (server, port, ...)` and `serve`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from common.config import PrefillConfig
from common.counters import Counters
from common.handoff.layout import DEFAULT_MAX_CHUNK_BYTES
from common.handoff.nixl_agent import open_agent
from common.handoff.planes import host_identity
from common.log import make_logger
from common.metrics import ServiceMetrics, capacity_gauges
from common.pb.kvhandoff.v1 import handoff_pb2, stats_pb2, stats_pb2_grpc
from common.server.grpc_server import (TlsFiles, create_server, run_async, serve_until_signalled,
                                       set_serving)
from common.server.loopback import is_loopback_host
from common.server.core_borrowing import CoreBorrowing
from common.server.torch_threads import in_passing_thread_async
from common.server.runtime import build_service_runtime, warm_up
from common.server.stats import StatsServicer
from prefill_svc.engine import PrefillEngine
from prefill_svc.send_budget import SendBudget
from prefill_svc.handoff_leases import HandoffLeases
from prefill_svc.prefix_cache import PrefixCache, PrefixCacheConfig, cache_gauges
from prefill_svc.nixl_sender import NixlPlane
from prefill_svc.page_lease import PageLeaseConfig
from prefill_svc.servicer import HandoffServicer, PlaneOffer, add_handoff_service
from prefill_svc.validation import PrefillLimits

SERVICE_NAMES = [handoff_pb2.DESCRIPTOR.services_by_name["HandoffService"].full_name,
                 stats_pb2.DESCRIPTOR.services_by_name["StatsService"].full_name]


@dataclass
class RunningPrefill:
    server: grpc.aio.Server
    port: int
    health: object
    engine: PrefillEngine
    metrics_port: int
    log: object
    leases: HandoffLeases
    nixl: NixlPlane | None = None


async def start_prefill(config: PrefillConfig) -> RunningPrefill:
    svc = config.service
    log = make_logger("prefill")
    runtime = build_service_runtime(svc, log, max_pass_tokens=config.max_batch_tokens)
    refusals, counters = Counters(), Counters()
    allocator = runtime.pool.allocator
    cache = PrefixCache(runtime.pool, PrefixCacheConfig(config.prefix_cache,
                                                        config.prefix_cache_max_pages), counters)
    metrics = ServiceMetrics("prefill", lambda: allocator.num_pages,
                             lambda: allocator.snapshot().pages_available,
                             lambda: engine.running_count(), lambda: engine.waiting_count(),
                             model_name=svc.model,
                             counters=counters,
                             limits=capacity_gauges(runtime.capacity,
                                                    lambda: runtime.capacity.max_prompt_tokens),
                             gauges=cache_gauges(cache))
    engine = PrefillEngine(runtime.model, runtime.pool, runtime.layout, config.max_batch_tokens,
                           log, counters, SendBudget(config.max_unsent_bytes), metrics,
                           prefill_chunk_tokens=config.prefill_chunk_tokens, prefix_cache=cache,
                           cores=CoreBorrowing(runtime.cores, counters))
    planes = plane_offer(config, log)
    limits = PrefillLimits(
        vocab_size=runtime.loaded.config.vocab_size, context_window=runtime.capacity.context_window,
        pool_tokens=runtime.capacity.pool_tokens, model_fingerprint=runtime.loaded.fingerprint,
        min_chunk_bytes=runtime.layout.kv_bytes_per_token_per_layer,
        data_planes=planes.served(), shm_host_id=planes.shm_host_id)
    stats = StatsServicer("prefill", allocator, runtime.capacity,
                          lambda: runtime.capacity.max_prompt_tokens, refusals, counters,
                          engine.running_count, engine.waiting_count)
    handoff = HandoffServicer(engine, runtime.layout, runtime.capacity, limits, refusals, log,
                              metrics, planes)

    def register(server: grpc.aio.Server) -> list[str]:
        add_handoff_service(handoff, server)
        stats_pb2_grpc.add_StatsServiceServicer_to_server(stats, server)
        return SERVICE_NAMES

    tls = TlsFiles(svc.tls_cert, svc.tls_key, svc.tls_ca) if svc.tls_cert else None
    if tls is None and not is_loopback_host(svc.host):
        log.warning("insecure_handoff", message="the handoff service listens without TLS on a "
                    "non-loopback address; configure --tls-cert/--tls-key/--tls-ca")
    server, port, health = await create_server(register, svc.host, svc.port, tls,
                                               DEFAULT_MAX_CHUNK_BYTES + (1 << 20))
    metrics_port = metrics.serve_http(svc.host, svc.metrics_port) if svc.metrics_port >= 0 else -1
    # health keeps answering meanwhile; the warm-up's torch team ends with its thread
    await in_passing_thread_async(warm_up, runtime)
    engine.start()
    await set_serving(health, SERVICE_NAMES, True)
    log.info("serving", role="prefill", address=f"{svc.host}:{port}", metrics_port=metrics_port)
    return RunningPrefill(server, port, health, engine, metrics_port, log, handoff.leases,
                          planes.nixl)


def plane_offer(config: PrefillConfig, log) -> PlaneOffer:
    """Shared memory is offered when enabled, its directory usable, and either no TLS is
    configured or the operator allowed planes that bypass it (P-60, P-64); NIXL likewise, when
    its agent starts (P-65)."""
    svc = config.service
    if svc.tls_cert and not svc.allow_planes_without_tls:
        if config.shared_memory or config.nixl:
            log.info("planes_off", message="TLS is configured and the shared-memory and NIXL "
                     "planes bypass it; start with --allow-planes-without-tls to offer them")
        return PlaneOffer(release_grace_s=config.release_grace_s)
    nixl = nixl_plane(log, is_loopback_host(svc.host)) if config.nixl else None
    host_id = host_identity(svc.shm_dir) if config.shared_memory else ""
    if config.shared_memory and not host_id:
        log.warning("shared_memory_unusable", shm_dir=svc.shm_dir,
                    message="the shared-memory directory is missing or not writable")
    lease = PageLeaseConfig(config.nixl_from_pages, config.nixl_lease_max_pages,
                            config.nixl_lease_max_handoffs)
    return PlaneOffer(host_id, svc.shm_dir if host_id else "", config.release_grace_s, nixl,
                      lease)


def nixl_plane(log, loopback: bool) -> NixlPlane | None:
    """loopback: prefill listens on loopback only, so its decodes are on this host and UCX is
    kept on it (unless UCX_NET_DEVICES/UCX_TLS are set)."""
    agent, why = open_agent("prefill", loopback)
    if agent is None:
        log.info("nixl_unavailable", message=f"the NIXL plane is not offered: {why}")
        return None
    return NixlPlane(agent)


def serve(config: PrefillConfig, port_file: Path | None = None) -> None:
    async def main() -> None:
        running = await start_prefill(config)
        if port_file is not None:
            port_file.write_text(str(running.port))

        async def on_stop() -> None:
            running.engine.stop()
            running.leases.close()  # unlink every region, deregister every buffer still pinned
            if running.nixl is not None:
                running.nixl.close()

        await serve_until_signalled(running.server, running.health,
                                    config.service.grace_seconds, on_stop, log=running.log)

    run_async(main)
