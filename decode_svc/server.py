"""Starts the decode service: the client-facing front door, after its handshake with prefill."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.config import DecodeConfig
from common.counters import Counters
from common.handoff.layout import PROTOCOL_MAJOR, PROTOCOL_MINOR_BOUND, describe_layout
from common.handoff.planes import INLINE, NIXL, SHARED_MEMORY, offered
from common.log import make_logger
from common.metrics import ServiceMetrics, capacity_gauges
from common.pb.kvhandoff.v1 import generate_pb2, generate_pb2_grpc, stats_pb2, stats_pb2_grpc
from common.server.tenant_auth import TenantAuth
from common.server.tenants import TenantTokens
from common.server.grpc_server import (TlsFiles, create_server, run_async, serve_until_signalled,
                                       set_serving)
from common.server.loopback import is_loopback_host, is_loopback_target
from common.server.core_borrowing import CoreBorrowing
from common.server.torch_threads import in_passing_thread_async
from common.server.runtime import Runtime, build_service_runtime, warm_up
from common.server.stats import StatsServicer
from common.server.tls_diagnosis import DialSide, diagnose
from decode_svc.cache_scope import identity_of_calls
from decode_svc.content_check import ContentCheckConfig
from decode_svc.engine import DecodeEngine
from decode_svc.handoff import HandoffPolicy, InlineReceiver
from decode_svc.engine_answer import engine_answer
from decode_svc.handoff_retry import RetryingReceiver
from decode_svc.http.app import serve_openai
from decode_svc.kv_receiver import KvReceiver
from decode_svc.conditional_prefill import ConditionalPrefillConfig, ConditionalReceiver
from decode_svc.local_prefill import LocalPrefillEngine, LocalPrefillReceiver, agree_locally
from decode_svc.plane_select import NegotiatedReceiver, plane_for
from decode_svc.prefill_choice import make_chooser
from decode_svc.prefill_replicas import PrefillReplicas
from decode_svc.servicer import GenerationServicer
from decode_svc.nixl_receiver import nixl_receivers
from decode_svc.shm_receiver import SharedMemoryReceiver
from decode_svc.state import DecodeState
from decode_svc.validation import DecodeLimits

SERVICE_NAMES = [generate_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name,
                 stats_pb2.DESCRIPTOR.services_by_name["StatsService"].full_name]


@dataclass
class RunningDecode:
    server: grpc.aio.Server
    port: int
    health: object
    engine: DecodeEngine
    client: PrefillReplicas
    handshake: asyncio.Task
    metrics_port: int
    log: object
    auth: TenantAuth | None = None  # None: the client API checks no tokens
    http: object = None  # the OpenAI-compatible HTTP API's aiohttp runner (None: off)
    http_port: int = -1


def _agree(config: DecodeConfig, runtime: Runtime, info, current: DecodeLimits | None
           ) -> tuple[DecodeLimits | None, str]:
    """Limits from one prefill's info, made no looser than what is already agreed; or why not."""
    mine = runtime.loaded.fingerprint
    if not config.allow_protocol_1_0 and not speaks_bound_handoffs(info):
        versions = ", ".join(f"{v.major}.{v.minor}" for v in info.protocol_versions) or "none"
        return None, (f"prefill speaks protocol {versions}; this decode requires 1.1, which binds "
                      "each handoff to its prompt (start decode with --allow-protocol-1-0 to "
                      "accept 1.0); refusing all requests")
    if info.model_fingerprint != mine or not runtime.layout.matches(info.layout):
        return None, (f"prefill serves model {info.model_fingerprint} with layout "
                      f"{describe_layout(info.layout)}; this decode serves {mine} with "
                      f"{describe_layout(runtime.layout.to_proto())}; refusing all requests")
    capacity = runtime.capacity
    limits = DecodeLimits(
        vocab_size=runtime.loaded.config.vocab_size,
        context_window=min(capacity.context_window, int(info.max_context_tokens)),
        own_pool_tokens=capacity.pool_tokens,
        prefill_max_prompt=min(capacity.max_prompt_tokens, int(info.max_prompt_tokens)),
        default_max_tokens=config.default_max_tokens,
        prefill_page_size=int(info.page_size))
    if current is not None:
        limits = dataclasses.replace(
            limits, context_window=min(limits.context_window, current.context_window),
            prefill_max_prompt=min(limits.prefill_max_prompt, current.prefill_max_prompt),
            prefill_page_size=math.gcd(limits.prefill_page_size, current.prefill_page_size))
    return limits, ""


def _agree_replicas(config: DecodeConfig, runtime: Runtime, infos, current: DecodeLimits | None,
                    nixl: bool):
    """-> (limits, refusal, plane, info): `_agree` over every replica that answered (the first
    refusal, naming its replica, wins; the strictest limits otherwise), one plane all of them
    allow (with --data-plane auto, inline when they differ), and the info with the smallest
    prompt limit (for the log)."""
    limits, refusal, planes = current, "", set()
    for name, info in infos:
        limits, why = _agree(config, runtime, info, limits)
        plane, plane_why = plane_for(config, info, nixl)
        if why or plane_why:
            refusal = f"prefill replica {name}: {why or plane_why}" if len(infos) > 1 else (
                why or plane_why)
            return None, refusal, INLINE, info
        planes.add(plane)
    plane = planes.pop() if len(planes) == 1 else INLINE  # a named plane: all agreed on it
    return limits, "", plane, min((i for _, i in infos), key=lambda i: i.max_prompt_tokens)


def log_prefill_not_reached(config: DecodeConfig, target: str, err: grpc.aio.AioRpcError,
                            log) -> None:
    """prefill_tls_failed (error) with the cause and the fix when gRPC's details show a TLS
    handshake that failed (wrong CA, SAN mismatch, client certificate missing or refused),
    else prefill_unreachable (warning) with the code and details."""
    svc = config.service
    entries = [e.strip() for e in target.split(",")]
    host = entries[0].rpartition(":")[0].strip("[]") if len(entries) == 1 else ""
    side = DialSide(tls=bool(svc.tls_cert), client_cert=bool(svc.tls_cert), ca_file=svc.tls_ca,
                    server_name=host)
    tls = diagnose(err.details() or "", target, side)
    if tls is not None:
        log.error("prefill_tls_failed", target=target, cause=tls.cause.value,
                  message=tls.message, code=err.code().name, details=err.details())
    else:
        log.warning("prefill_unreachable", target=target, code=err.code().name,
                    details=err.details())


def speaks_bound_handoffs(info) -> bool:
    """Does the prefill advertise a 1.x version with the 1.1 binding?"""
    return any(v.major == PROTOCOL_MAJOR and v.minor >= PROTOCOL_MINOR_BOUND
               for v in info.protocol_versions)


async def handshake(config: DecodeConfig, runtime: Runtime, client: PrefillReplicas,
                    state: DecodeState, health, log, nixl: bool = False) -> None:
    """Asks every prefill replica for its model, layout and limits, at start and then every
    prefill_info_interval_s. Decode serves only once they agree, refuses everything when a
    replica differs in model or layout, and keeps the strictest limits any replica reported."""
    while True:
        try:
            infos = await client.infos(timeout=10.0)
        except grpc.aio.AioRpcError as err:
            log_prefill_not_reached(config, client.target, err, log)
            await asyncio.sleep(1.0)
            continue
        limits, refusal, plane, info = _agree_replicas(config, runtime, infos, state.limits, nixl)
        if not refusal and plane != state.plane:
            log.info("data_plane_chosen", plane=plane, wanted=config.data_plane,
                     offered=sorted(offered(info)))
            state.plane = plane
        if refusal:
            if not state.refusing:
                log.error("prefill_mismatch", target=client.target, message=refusal)
                await set_serving(health, SERVICE_NAMES, False)
            state.refusing = refusal
        elif state.refusing:
            log.info("prefill_agreed_again", target=client.target,
                     message="prefill now agrees on model and layout; serving again")
            state.refusing = ""
            state.limits = limits
            await set_serving(health, SERVICE_NAMES, True)
        elif limits != state.limits:
            if state.limits is None:
                log.info("prefill_agreed", target=client.target,
                         prefill_max_prompt=info.max_prompt_tokens,
                         effective_max_prompt=limits.prefill_max_prompt,
                         context_window=limits.context_window)
                await set_serving(health, SERVICE_NAMES, True)
            else:
                log.warning("prefill_limits_disagree", target=client.target,
                            reported_max_prompt=info.max_prompt_tokens,
                            effective_max_prompt=limits.prefill_max_prompt,
                            message="prefill replicas report different limits; using the "
                                    "strictest")
            state.limits = limits
        await asyncio.sleep(config.prefill_info_interval_s)


def handoff_in_clear_text(config: DecodeConfig) -> bool:
    """Would prompts and KV cross a network unencrypted: a prefill off this machine, no TLS?"""
    return (not config.service.tls_cert and not config.local_prefill
            and not is_loopback_target(config.prefill_target))


def local_pass_tokens(capacity) -> int:
    """The most prompt tokens one of decode's own prefill passes may carry: its pool and window
    bound a prompt, and its activation budget was measured at a pass of max_pass_tokens."""
    return min(capacity.max_prompt_tokens, capacity.max_pass_tokens or capacity.max_prompt_tokens)


def conditional_prefill(config: DecodeConfig, runtime) -> ConditionalPrefillConfig:
    """--local-prefill-max-tokens, refused (ValueError) with --local-prefill (which prefills
    every prompt here) or past the longest prompt decode can prefill itself: its pool and
    window, and the pass its activation budget was measured at; --local-prefill-burst-tokens
    (a burst's share kept here, at most that pass) only beside it; --local-prefill-queue-depth
    (prompts taken from prefill's queue, in chunks of --local-prefill-chunk-tokens, at most
    that pass) not with --local-prefill."""
    threshold = config.local_prefill_max_tokens
    if threshold and config.local_prefill:
        raise ValueError("--local-prefill-max-tokens with --local-prefill: --local-prefill "
                         "already prefills every prompt here; give one of them")
    longest = local_pass_tokens(runtime.capacity)
    if threshold > longest:
        raise ValueError(f"--local-prefill-max-tokens {threshold} exceeds the longest prompt "
                         f"this decode can prefill itself ({longest} tokens)")
    burst = config.local_prefill_burst_tokens
    if burst and not threshold:
        raise ValueError("--local-prefill-burst-tokens without --local-prefill-max-tokens: "
                         "decode keeps no prompt, so there is no burst to share")
    depth = config.local_prefill_queue_depth
    if depth and config.local_prefill:
        raise ValueError("--local-prefill-queue-depth with --local-prefill: --local-prefill "
                         "already prefills every prompt here; give one of them")
    return ConditionalPrefillConfig(threshold, max_kept_tokens=min(burst or threshold, longest),
                                    queue_depth=depth,
                                    chunk_tokens=min(config.local_prefill_chunk_tokens, longest),
                                    longest_tokens=runtime.capacity.max_prompt_tokens)


async def start_decode(config: DecodeConfig) -> RunningDecode:
    svc = config.service
    log = make_logger("decode")
    runtime = build_service_runtime(svc, log)
    refusals, counters = Counters(), Counters()
    conditional = conditional_prefill(config, runtime)
    content = ContentCheckConfig(config.content_checks, config.verify_depth_positions,
                                 config.verify_full_fraction)
    engine_args = (runtime.model, runtime.pool, config.max_batch, config.max_waiting, log,
                   counters, content, CoreBorrowing(runtime.cores, counters))
    if config.local_prefill or conditional.enabled:  # prompts of a round share a pass
        engine = LocalPrefillEngine(*engine_args,
                                    pass_tokens=local_pass_tokens(runtime.capacity))
    else:
        engine = DecodeEngine(*engine_args)
    policy = HandoffPolicy(config.allow_protocol_1_0, content)
    if config.allow_protocol_1_0:
        log.warning("protocol_1_0_allowed", message="decode accepts prefills that speak protocol "
                    "1.0: their handoffs carry no nonce, prompt digest or frame checksums; each "
                    "such handoff is counted (handoffs_protocol_1_0)")
    if not config.content_checks:
        log.warning("content_checks_disabled", message="decode does not check the KV content of "
                    "handoffs (--no-content-checks): a prefill that sends well-formed KV of the "
                    "wrong tokens is not caught; use this only to measure the checks' cost")
    peer_tls = TlsFiles(svc.tls_cert, svc.tls_key, svc.tls_ca) if svc.tls_cert else None
    client = PrefillReplicas(config.prefill_target, config.max_chunk_bytes, peer_tls,
                             make_chooser(config.prefill_choice, config.prefill_busy_slack),
                             runtime.capacity.page_size, log,
                             resolve_interval_s=config.prefill_info_interval_s,
                             on_eject=lambda name: (counters.add("prefill_ejected"),
                                                    metrics.ejected()))
    state = DecodeState()
    allocator = runtime.pool.allocator
    metrics = ServiceMetrics("decode", lambda: allocator.num_pages,
                             lambda: allocator.snapshot().pages_free, engine.running_count,
                             engine.waiting_count, model_name=svc.model, counters=counters,
                             limits=capacity_gauges(
                                 runtime.capacity,
                                 lambda: state.limits.prefill_max_prompt if state.limits else 0),
                             gauges={"prefill_replicas_healthy": (
                                         "Prefill replicas whose grpc.health.v1 says SERVING",
                                         client.num_healthy),
                                     "prefill_replicas_ejected": (
                                         "Prefill replicas ejected by their circuit breaker "
                                         "(cooling down)", client.num_ejected)})
    tokens = TenantTokens.from_settings(config.api_token, config.api_tokens)
    auth = TenantAuth(tokens, metrics.registry, "decode", svc.model, log) if tokens else None
    nixl = nixl_receivers(config, client, engine, counters, log)  # {} or {NIXL: receiver}
    if config.local_prefill:
        receiver: KvReceiver = LocalPrefillReceiver(engine)
    else:
        receiver = RetryingReceiver(
            NegotiatedReceiver(
                {INLINE: InlineReceiver(client, engine),
                 SHARED_MEMORY: SharedMemoryReceiver(client, engine, svc.shm_dir)}
                | nixl, state,
                fallback=config.data_plane == "auto", counters=counters),
            client, counters, metrics.retried, log, config.handoff_retries,
            new_attempt=lambda request_id: engine_answer(
                lambda done: engine.new_attempt(request_id, done)))
        if conditional.enabled:  # short prompts at an idle decode, or a share under load
            receiver = ConditionalReceiver(conditional, engine, receiver, counters)
    generation = GenerationServicer(
        engine, client, state, runtime.layout, runtime.loaded.fingerprint,
        runtime.loaded.tokenizer, runtime.loaded.config.eos_token_ids, config.max_chunk_bytes,
        config.handoff_timeout_s, refusals, metrics, log, policy,
        receiver,
        identity_of_calls(auth is not None))
    stats = StatsServicer(
        "decode", allocator, runtime.capacity,
        lambda: state.limits.prefill_max_prompt if state.limits else 0, refusals, counters,
        engine.running_count, engine.waiting_count)

    def register(server: grpc.aio.Server) -> list[str]:
        generate_pb2_grpc.add_GenerationServiceServicer_to_server(generation, server)
        stats_pb2_grpc.add_StatsServiceServicer_to_server(stats, server)
        return SERVICE_NAMES

    if handoff_in_clear_text(config):
        log.warning("insecure_handoff", target=config.prefill_target, message="decode talks to "
                    "a prefill off this machine without TLS: prompts and KV cross the network in "
                    "clear text; configure --tls-cert/--tls-key/--tls-ca")
    public = not is_loopback_host(svc.host)
    if public and auth and not config.api_tls_cert:
        log.warning("api_token_without_tls", message="API tokens are set but the client API has "
                    "no TLS: tokens travel in cleartext; set --api-tls-cert/--api-tls-key")
    elif public and not auth and not config.api_tls_cert:
        log.warning("public_api_unauthenticated", message="the client API listens on a "
                    "non-loopback address with neither TLS nor a bearer token")
    interceptors = [auth.interceptor] if auth else []
    api_tls = TlsFiles(config.api_tls_cert, config.api_tls_key) if config.api_tls_cert else None
    server, port, health = await create_server(register, svc.host, svc.port, api_tls, 4 << 20,
                                               interceptors)
    metrics_port = metrics.serve_http(svc.host, svc.metrics_port) if svc.metrics_port >= 0 else -1
    http, http_port = await serve_openai(config, generation.lifecycle, health, metrics.registry,
                                         auth, log)
    # health keeps answering meanwhile; the warm-up's torch team ends with its thread
    await in_passing_thread_async(warm_up, runtime)
    engine.observe_steps(metrics.decode_step)
    engine.start()
    if not config.local_prefill:
        await client.start()
    task = asyncio.ensure_future(
        agree_locally(config, runtime, state, health, SERVICE_NAMES, log) if config.local_prefill
        else handshake(config, runtime, client, state, health, log, NIXL in nixl))
    log.info("listening", role="decode", address=f"{svc.host}:{port}", metrics_port=metrics_port,
             http_port=http_port, prefill=config.prefill_target)
    return RunningDecode(server, port, health, engine, client, task, metrics_port, log, auth,
                         http, http_port)


def serve(config: DecodeConfig, port_file: Path | None = None) -> None:
    async def main() -> None:
        running = await start_decode(config)
        if running.auth is not None:
            running.auth.reload_on_sighup()  # --api-tokens FILE: SIGHUP reads it again
        if port_file is not None:
            port_file.write_text(str(running.port))

        async def on_stop() -> None:
            running.handshake.cancel()
            if running.http is not None:
                await running.http.cleanup()
            running.engine.stop()
            await running.client.close()

        await serve_until_signalled(running.server, running.health,
                                    config.service.grace_seconds, on_stop, log=running.log)

    run_async(main)
