"""Decode's prefill replicas: one channel each, their health, their load, their breakers, and
the choice of one per handoff attempt.

`PrefillReplicas` has the surface the receivers use of a PrefillClient (`prefill`, `release`,
`target`, `close`), so a receiver never knows how its replica was chosen; `infos` feeds the
handshake every replica's GetPrefillInfo.

The target (`--prefill`) is a comma-separated list of `host:port`. An entry whose host is an
IP literal or `localhost` is one replica; an entry whose host is another name is resolved now
and every `resolve_interval_s` (the compose DNS and k8s headless Service way): each address is
a replica, named `address:port`, whose TLS name stays the entry's host; an address that leaves
the DNS answer leaves the choice, and its channel closes once no handoff uses it.

Invariants:
- a handoff attempt goes to a replica that is SERVING by grpc.health.v1 (a replica not yet
  heard from counts only while no replica is known to serve, and any live replica while none
  is known to serve or to be starting: health never empties the choice), not ejected by its
  breaker (unless every such replica is: the breakers never empty the choice either), and not
  already tried by the same request while another such replica exists;
- `in_flight` counts the Prefill calls open to a replica: +1 when one is made, -1 when gRPC says
  it is done, whatever ended it;
- ReleaseHandoff goes to the replica that served the handoff it names (by nonce);
- every attempt's outcome (`report`) reaches the breaker of the replica it went to.
Event loop only.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.handoff.reasons import HandoffRefused
from common.pb.kvhandoff.v1 import handoff_pb2
from common.server.grpc_server import TlsFiles
from common.server.prefill_target import parse_target
from decode_svc.prefill_breaker import BreakerConfig, BreakerState, CircuitBreaker
from decode_svc.prefill_choice import Candidate, PrefillChooser, route_key
from decode_svc.prefill_client import HandoffStream, PrefillClient

HEALTH_SERVICE = "kvhandoff.v1.HandoffService"
HEALTH_RETRY_S = 1.0
RELEASE_ROUTES_MAX = 4096
OUT_OF_BAND = (handoff_pb2.DATA_PLANE_SHARED_MEMORY, handoff_pb2.DATA_PLANE_NIXL)


@dataclass
class Replica:
    name: str  # host:port as dialled
    client: PrefillClient
    breaker: CircuitBreaker
    serving: bool | None = None  # grpc.health.v1's last word; None: not heard yet
    in_flight: int = 0
    handoffs: int = 0
    removed: bool = False  # left the DNS answer: closes once idle
    watch: asyncio.Task | None = None


@dataclass
class _Attempts:
    tried: list[str] = field(default_factory=list)


class PrefillReplicas:
    def __init__(self, target: str, max_chunk_bytes: int, tls: TlsFiles | None,
                 chooser: PrefillChooser, page_size: int, log,
                 breaker: BreakerConfig | None = None, resolve_interval_s: float = 5.0,
                 on_eject: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.target = target
        self.entries = parse_target(target)
        self.max_chunk_bytes = max_chunk_bytes
        self.tls = tls
        self.chooser = chooser
        self.page_size = page_size
        self.log = log
        self.breaker_config = breaker or BreakerConfig()
        self.resolve_interval_s = resolve_interval_s
        self.on_eject = on_eject or (lambda name: None)
        self.clock = clock
        self.replicas: dict[str, Replica] = {}
        self._attempts: dict[str, _Attempts] = {}
        self._release_routes: OrderedDict[bytes, str] = OrderedDict()
        self._ever_answered = False
        self._resolver: asyncio.Task | None = None
        for entry in self.entries:
            if not entry.resolve:
                self._add(f"{entry.host}:{entry.port}", None)

    async def start(self) -> None:
        """Resolves the DNS entries once, then keeps them resolved; watches every replica's
        health. Call on the loop that will use the replicas."""
        if any(e.resolve for e in self.entries):
            await self._resolve_all()
            self._resolver = asyncio.ensure_future(self._keep_resolving())
        for replica in self.replicas.values():
            if replica.watch is None:
                self._watch(replica)

    # --- the choice -------------------------------------------------------------------------

    def prefill(self, request: handoff_pb2.PrefillRequest, timeout: float) -> HandoffStream:
        """Opens the Prefill call on the replica chosen for this attempt of the request;
        HandoffRefused(UNAVAILABLE, PEER_UNAVAILABLE) when no replica may take it."""
        replica = self._choose(request)
        self._attempts.setdefault(request.request_id, _Attempts()).tried.append(replica.name)
        if request.data_plane in OUT_OF_BAND:
            self._release_routes[bytes(request.nonce)] = replica.name
            while len(self._release_routes) > RELEASE_ROUTES_MAX:
                self._release_routes.popitem(last=False)
        replica.breaker.started()
        replica.in_flight += 1
        replica.handoffs += 1
        stream = replica.client.prefill(request, timeout)
        stream.add_done_callback(lambda _call: self._call_done(replica))
        return stream

    def has_untried(self, request_id: str) -> bool:
        """Is there a replica this request may still go to that it has not been to?"""
        tried = set(self._attempts.get(request_id, _Attempts()).tried)
        return any(r.name not in tried for r in self._usable())

    def last_tried(self, request_id: str) -> str:
        attempts = self._attempts.get(request_id)
        return attempts.tried[-1] if attempts and attempts.tried else ""

    def report(self, request_id: str, failure: str | None, judged: bool = True) -> None:
        """The outcome of the request's latest attempt: failure None for a verified handoff;
        judged False when it ended for a reason that says nothing of the replica."""
        replica = self.replicas.get(self.last_tried(request_id))
        if replica is None:
            return
        if not judged:
            replica.breaker.ended_unjudged()
        elif failure is None:
            replica.breaker.succeeded()
        elif replica.breaker.failed(self.clock()):
            self.log.warning("prefill_ejected", replica=replica.name, reason=failure,
                             failures=replica.breaker.failures,
                             cool_down_s=self.breaker_config.cool_down_s,
                             message="prefill replica ejected from the choice after "
                                     "consecutive failed handoffs")
            self.on_eject(replica.name)

    def forget(self, request_id: str) -> None:
        self._attempts.pop(request_id, None)

    def _usable(self) -> list[Replica]:
        now = self.clock()
        live = [r for r in self.replicas.values() if not r.removed]
        serving = [r for r in live if r.serving]
        # health steers, never empties: with no replica known to serve, the attempt itself
        # finds out (a replica that is starting, or whose watch has not caught up with a
        # channel that just connected, serves it; a dead one fails it as a transport failure)
        pool = serving or [r for r in live if r.serving is None] or live
        # a breaker steers away from a replica, never away from all: ejecting the last one
        # would turn each bad handoff into a refusal of every request that follows
        return [r for r in pool if r.breaker.allows(now)] or pool

    def _choose(self, request: handoff_pb2.PrefillRequest) -> Replica:
        usable = self._usable()
        tried = set(self._attempts.get(request.request_id, _Attempts()).tried)
        candidates = [r for r in usable if r.name not in tried] or usable
        name = self.chooser.choose(
            route_key(bytes(request.cache_scope), request.token_ids, self.page_size),
            [Candidate(r.name, r.in_flight) for r in candidates])
        if name is None:
            raise HandoffRefused(grpc.StatusCode.UNAVAILABLE, "PEER_UNAVAILABLE",
                                 f"no prefill replica can take the handoff: {self.describe()}")
        return self.replicas[name]

    def describe(self) -> str:
        now = self.clock()
        return ", ".join(
            f"{r.name} {self._condition(r, now)}" for r in self.replicas.values()
            if not r.removed) or f"no address for {self.target}"

    @staticmethod
    def _condition(replica: Replica, now: float) -> str:
        if not replica.breaker.allows(now):
            return "ejected"
        return {True: "serving", False: "not serving", None: "not heard from"}[replica.serving]

    # --- what the handshake, release and metrics need ----------------------------------------

    async def infos(self, timeout: float) -> list[tuple[str, handoff_pb2.GetPrefillInfoResponse]]:
        """(replica, GetPrefillInfo) of every replica that answered; until one ever has, each
        call waits for its replica to be ready. Raises the first error when none answered."""
        replicas = [r for r in self.replicas.values() if not r.removed]
        results = await asyncio.gather(
            *(r.client.info(timeout, wait_for_ready=not self._ever_answered) for r in replicas),
            return_exceptions=True)
        answered, errors = [], []
        for replica, result in zip(replicas, results):
            if isinstance(result, grpc.aio.AioRpcError):
                errors.append(result)
            elif isinstance(result, BaseException):
                raise result
            else:
                answered.append((replica.name, result))
        if not answered:
            if errors:
                raise errors[0]
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), f"no address for {self.target}")
        self._ever_answered = True
        return answered

    async def release(self, request_id: str, nonce: bytes, timeout: float) -> bool:
        """ReleaseHandoff on the replica that served the handoff; False when it is unknown."""
        replica = self.replicas.get(self._release_routes.pop(bytes(nonce), ""))
        if replica is None:
            return False
        return await replica.client.release(request_id, nonce, timeout)

    def num_healthy(self) -> int:
        return sum(1 for r in self.replicas.values() if r.serving and not r.removed)

    def num_ejected(self) -> int:
        return sum(1 for r in self.replicas.values()
                   if r.breaker.state == BreakerState.OPEN and not r.removed)

    async def close(self) -> None:
        if self._resolver is not None:
            self._resolver.cancel()
        for replica in list(self.replicas.values()):
            await self._close(replica)

    # --- channels, health, DNS ----------------------------------------------------------------

    def _add(self, name: str, tls_name: str | None) -> Replica:
        client = PrefillClient(name, self.max_chunk_bytes, self.tls, tls_name=tls_name)
        replica = Replica(name, client, CircuitBreaker(self.breaker_config))
        self.replicas[name] = replica
        return replica

    def _call_done(self, replica: Replica) -> None:
        replica.in_flight -= 1
        if replica.removed and replica.in_flight == 0:
            asyncio.ensure_future(self._close(replica))

    async def _close(self, replica: Replica) -> None:
        if replica.watch is not None:
            replica.watch.cancel()
        self.replicas.pop(replica.name, None)
        await replica.client.close()

    def _watch(self, replica: Replica) -> None:
        replica.watch = asyncio.ensure_future(self._watch_health(replica))

    async def _watch_health(self, replica: Replica) -> None:
        stub = health_pb2_grpc.HealthStub(replica.client.channel)
        while True:
            try:
                # after a failure, wait for the channel to connect rather than fail fast in its
                # reconnect backoff: the answer comes the moment the replica is reachable
                async for answer in stub.Watch(
                        health_pb2.HealthCheckRequest(service=HEALTH_SERVICE),
                        wait_for_ready=replica.serving is False):
                    self._set_serving(replica,
                                      answer.status == health_pb2.HealthCheckResponse.SERVING)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:  # no health service: trust it
                    self._set_serving(replica, True)
                    return
                self._set_serving(replica, False)
            await asyncio.sleep(HEALTH_RETRY_S)

    def _set_serving(self, replica: Replica, serving: bool) -> None:
        if serving != replica.serving and replica.serving is not None:
            self.log.info("prefill_replica_health", replica=replica.name,
                          serving=serving)
        replica.serving = serving

    async def _keep_resolving(self) -> None:
        while True:
            await asyncio.sleep(self.resolve_interval_s)
            await self._resolve_all()

    async def _resolve_all(self) -> None:
        loop = asyncio.get_running_loop()
        wanted: dict[str, str] = {}
        for entry in self.entries:
            if not entry.resolve:
                wanted[f"{entry.host}:{entry.port}"] = ""
                continue
            try:
                answers = await loop.getaddrinfo(entry.host, int(entry.port),
                                                 type=socket.SOCK_STREAM)
            except OSError as err:
                self.log.warning("prefill_resolve_failed", host=entry.host, error=str(err))
                wanted.update({n: entry.host for n, r in self.replicas.items()
                               if r.client.tls_name == entry.host})  # keep what we had
                continue
            for family, _, _, _, sockaddr in answers:
                address = f"[{sockaddr[0]}]" if family == socket.AF_INET6 else sockaddr[0]
                wanted[f"{address}:{entry.port}"] = entry.host
        for name, tls_name in wanted.items():
            if name not in self.replicas:
                replica = self._add(name, tls_name or None)
                self.log.info("prefill_replica_added", replica=name, host=tls_name or name)
                self._watch(replica)
        for replica in list(self.replicas.values()):
            if replica.name not in wanted and not replica.removed:
                replica.removed = True
                self.log.info("prefill_replica_removed", replica=replica.name)
                if replica.in_flight == 0:
                    await self._close(replica)
