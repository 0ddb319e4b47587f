"""A prefill service whose model computes nothing, for measuring the transfer alone.

Everything but the forward pass is the real prefill: `PrefillEngine` (pages, per-layer emit,
pack_kv, frame encoding and crc32c on the engine thread), `HandoffServicer` registered by
`add_handoff_service`, `create_server`, gRPC. The pool is filled with random KV once; the
"forward pass" reports every layer stored at once and returns zero logits. The same process
also runs a plain TCP sender, the baseline the handoff is compared with.
"""

from __future__ import annotations

import asyncio
import io
import socket
import struct
import threading
from dataclasses import dataclass

import grpc
import torch

from common.capacity import Capacity
from common.config import PrefillConfig, ServiceConfig
from common.counters import Counters
from common.handoff.layout import DEFAULT_MAX_CHUNK_BYTES, KvLayout
from common.kvpool.kv_cache import KvPool, PoolConfig
from common.log import make_logger
from common.malloc_tuning import keep_freed_heap
from common.model.llama import PrefillBatch
from common.ops.torch_ops import TorchOps
from common.pb.kvhandoff.v1 import handoff_pb2
from common.server.grpc_server import create_server, set_serving
from prefill_svc.engine import PrefillEngine
from common.handoff.planes import DEFAULT_SHM_DIR, host_identity
from common.handoff.shm_region import RegionWriter
from prefill_svc.send_budget import SendBudget
from prefill_svc.servicer import HandoffServicer, PlaneOffer, add_handoff_service
from prefill_svc.validation import PrefillLimits

FINGERPRINT = "bench-synthetic-kv"
VOCAB = 1024
PAGE_SIZE = 16
SIZE_HEADER = struct.Struct("!Q")


class PoolOnlyModel:
    """Stands in for LlamaModel in an engine: a forward pass that leaves the pool as it is."""

    def __init__(self, layout: KvLayout) -> None:
        self.layout = layout
        self.ops = TorchOps()
        self.device = torch.device("cpu")

    def prefill(self, batch: PrefillBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                on_layer_stored=None) -> torch.Tensor:
        for layer in range(self.layout.num_layers):
            if on_layer_stored is not None:
                on_layer_stored(layer)
        return torch.zeros(batch.cu_seqlens.numel() - 1, VOCAB)

    def decode(self, *args, **kwargs) -> torch.Tensor:
        raise RuntimeError("the synthetic model does not decode")


def random_pool(layout: KvLayout, pool_tokens: int, seed: int = 0) -> KvPool:
    pool = KvPool(PoolConfig(pool_tokens=pool_tokens, page_size=PAGE_SIZE), layout.num_layers,
                  layout.num_kv_heads, layout.head_dim, layout.dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    for cache in (pool.k, pool.v):
        for layer in range(layout.num_layers):
            cache[layer].normal_(generator=gen)
    return pool


@dataclass(frozen=True)
class SyntheticSpec:
    layout: KvLayout
    pool_tokens: int
    torch_threads: int = 0  # 0: torch's default
    malloc_tuning: bool = True  # common.malloc_tuning.keep_freed_heap in the helper too


def _capacity(spec: SyntheticSpec) -> Capacity:
    return Capacity(PAGE_SIZE, spec.pool_tokens // PAGE_SIZE, spec.layout.kv_bytes_per_token,
                    spec.pool_tokens, "bench")


async def _serve(spec: SyntheticSpec, conn) -> None:
    log = make_logger("prefill", stream=io.StringIO())  # keep the benchmark's output clean
    model = PoolOnlyModel(spec.layout)
    pool = random_pool(spec.layout, spec.pool_tokens)
    engine = PrefillEngine(model, pool, spec.layout, spec.pool_tokens, log, Counters(),
                           SendBudget(PrefillConfig(ServiceConfig()).max_unsent_bytes),
                           prefill_chunk_tokens=spec.pool_tokens)  # nothing to chunk: one pass
    capacity = _capacity(spec)
    planes = PlaneOffer(host_identity(DEFAULT_SHM_DIR), DEFAULT_SHM_DIR)
    limits = PrefillLimits(vocab_size=VOCAB, context_window=spec.pool_tokens,
                           pool_tokens=capacity.pool_tokens, model_fingerprint=FINGERPRINT,
                           min_chunk_bytes=spec.layout.kv_bytes_per_token_per_layer,
                           data_planes=planes.served(), shm_host_id=planes.shm_host_id)
    servicer = HandoffServicer(engine, spec.layout, capacity, limits, Counters(), log,
                               planes=planes)

    names = [handoff_pb2.DESCRIPTOR.services_by_name["HandoffService"].full_name]

    def register(server) -> list[str]:
        add_handoff_service(servicer, server)
        server.add_generic_rpc_handlers((bare_grpc_handler(),))
        return names

    server, port, health = await create_server(register, "127.0.0.1", 0, None,
                                               DEFAULT_MAX_CHUNK_BYTES + (1 << 20))
    engine.start()
    await set_serving(health, names, True)  # decode's round_robin skips unhealthy replicas
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_socket_sender, args=(listener,), daemon=True).start()
    shm_listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_shm_sender, args=(shm_listener,), daemon=True).start()
    conn.send((port, listener.getsockname()[1], shm_listener.getsockname()[1]))
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
    listener.close()
    shm_listener.close()
    await server.stop(0)
    engine.stop()


def _serve_sized_requests(listener: socket.socket, send) -> None:
    """Per connection: read a size, then send(sock, payload) with that many bytes from memory,
    repeat until the connection closes; the one request loop of the bare transports."""
    payload = b""
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:
            return
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while header := _recv_exact(sock, SIZE_HEADER.size):
                (size,) = SIZE_HEADER.unpack(header)
                if len(payload) < size:
                    payload = torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes()
                send(sock, memoryview(payload)[:size])


def _socket_sender(listener: socket.socket) -> None:
    """The raw TCP baseline: the bytes themselves, on the socket."""
    _serve_sized_requests(listener, lambda sock, data: sock.sendall(data))


BARE_GRPC_METHOD = "/kvhandoff.bench.BareStream/Send"
BARE_GRPC_PIECE_BYTES = 4 << 20


def bare_grpc_handler() -> grpc.GenericRpcHandler:
    """The bare gRPC baseline, on the handoff's own server: a request of SIZE_HEADER bytes
    asks for that many bytes, streamed back as `bytes` messages of BARE_GRPC_PIECE_BYTES (the
    pieces are built once per size, so the sender only hands them to gRPC)."""
    pieces: list[bytes] = []

    async def send(request: bytes, context):
        (size,) = SIZE_HEADER.unpack(request)
        if sum(map(len, pieces)) != size:
            payload = torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes()
            pieces[:] = [payload[i:i + BARE_GRPC_PIECE_BYTES]
                         for i in range(0, size, BARE_GRPC_PIECE_BYTES)]
        for piece in pieces:
            yield piece

    service, method = BARE_GRPC_METHOD.strip("/").split("/")
    return grpc.method_handlers_generic_handler(service, {
        method: grpc.unary_stream_rpc_method_handler(send)})


SHM_PIECE_BYTES = 4 << 20
SHM_PIECE = struct.Struct("!32sQQ")  # region name (hex part), offset, length


def _shm_sender(listener: socket.socket) -> None:
    """The bare shared-memory transport: per request of N bytes, write them into a fresh 0600
    region in 4 MiB pieces and send each piece's (region, offset, length) once it is written;
    the reader's zero-length piece acknowledges the end, then the region is unlinked."""
    _serve_sized_requests(listener, _send_through_region)


def _send_through_region(sock: socket.socket, data: memoryview) -> None:
    size = len(data)
    region = RegionWriter(DEFAULT_SHM_DIR, size)
    try:
        name = region.name.removeprefix("kvh-").encode()
        for offset in range(0, size, SHM_PIECE_BYTES):
            n = min(SHM_PIECE_BYTES, size - offset)
            region.write(offset, data[offset:offset + n])
            sock.sendall(SHM_PIECE.pack(name, offset, n))
        sock.sendall(SHM_PIECE.pack(name, size, 0))
        _recv_exact(sock, 1)  # the reader is done
    finally:
        region.close()


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        part = sock.recv(size - len(data))
        if not part:
            return b""
        data += part
    return bytes(data)


def serve_in_process(spec: SyntheticSpec, conn) -> None:
    """Entry point of the spawned helper: sends (grpc port, socket port), then serves until
    anything arrives on conn."""
    from common.server.grpc_server import run_async

    if spec.torch_threads > 0:
        torch.set_num_threads(spec.torch_threads)
    if spec.malloc_tuning:
        keep_freed_heap()
    run_async(lambda: _serve(spec, conn))
