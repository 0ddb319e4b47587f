"""The prefill half of the NIXL rows of `kvhandoff bench transfer`, in a spawned process: the
synthetic prefill (bench/synthetic_prefill.py: the real engine, servicer and gRPC server over a
pool of random KV) offering the NIXL plane, and a bare NIXL sender moving the same bytes.

Bare NIXL: per request of N bytes on a loopback socket, the sender fills a buffer registered
with its agent (one per size, reused), and answers its partial agent metadata, the buffer's
address and the crc32c of its bytes; decode READs it in 4 MiB pieces into its own registered
buffer and checks the crc32c; its one-byte answer ends the request. The sender's progress
thread (prefill_svc.nixl_sender.NixlPlane) is what completes decode's READs, as in the service.
"""

from __future__ import annotations

import asyncio
import io
import socket
import struct
import threading

import numpy as np
import torch

from bench.synthetic_prefill import (FINGERPRINT, SIZE_HEADER, VOCAB, PoolOnlyModel,
                                     SyntheticSpec, _capacity, _recv_exact, random_pool)
from common.config import PrefillConfig, ServiceConfig
from common.counters import Counters
from common.handoff.crc import crc32c_extend
from common.handoff.layout import DEFAULT_MAX_CHUNK_BYTES
from common.handoff.nixl_agent import open_agent
from common.log import make_logger
from common.pb.kvhandoff.v1 import handoff_pb2
from common.server.grpc_server import create_server, set_serving
from prefill_svc.engine import PrefillEngine
from prefill_svc.nixl_sender import NixlPlane
from prefill_svc.send_budget import SendBudget
from prefill_svc.servicer import HandoffServicer, PlaneOffer, add_handoff_service
from prefill_svc.validation import PrefillLimits

ANSWER = struct.Struct("!QQI")  # metadata length, buffer address, crc32c; then the metadata


async def _serve(spec: SyntheticSpec, conn) -> None:
    log = make_logger("prefill", stream=io.StringIO())
    agent, why = open_agent("bench-prefill")
    if agent is None:
        conn.send(why)
        return
    nixl = NixlPlane(agent)
    pool = random_pool(spec.layout, spec.pool_tokens)
    engine = PrefillEngine(PoolOnlyModel(spec.layout), pool, spec.layout, spec.pool_tokens,
                           log, Counters(),
                           SendBudget(PrefillConfig(ServiceConfig()).max_unsent_bytes))
    capacity = _capacity(spec)
    planes = PlaneOffer(nixl=nixl)
    limits = PrefillLimits(vocab_size=VOCAB, context_window=spec.pool_tokens,
                           pool_tokens=capacity.pool_tokens, model_fingerprint=FINGERPRINT,
                           min_chunk_bytes=spec.layout.kv_bytes_per_token_per_layer,
                           data_planes=planes.served())
    servicer = HandoffServicer(engine, spec.layout, capacity, limits, Counters(), log,
                               planes=planes)
    names = [handoff_pb2.DESCRIPTOR.services_by_name["HandoffService"].full_name]

    def register(server) -> list[str]:
        add_handoff_service(servicer, server)
        return names

    server, port, health = await create_server(register, "127.0.0.1", 0, None,
                                               DEFAULT_MAX_CHUNK_BYTES + (1 << 20))
    engine.start()
    await set_serving(health, names, True)
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_bare_sender, args=(listener, nixl), daemon=True).start()
    conn.send((port, listener.getsockname()[1]))
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
    listener.close()
    await server.stop(0)
    servicer.leases.close()
    engine.stop()
    nixl.close()


def _bare_sender(listener: socket.socket, nixl: NixlPlane) -> None:
    buffers: dict[int, tuple[np.ndarray, bytes, int]] = {}
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:
            return
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while header := _recv_exact(sock, SIZE_HEADER.size):
                (size,) = SIZE_HEADER.unpack(header)
                if size not in buffers:
                    buf = torch.randint(0, 256, (size,), dtype=torch.uint8).numpy()
                    reg = nixl.agent.register(buf, share=True)
                    nixl.pinned(+1)
                    buffers[size] = (buf, reg.metadata, crc32c_extend(0, buf))
                buf, meta, crc = buffers[size]
                nixl.emitted()
                sock.sendall(ANSWER.pack(len(meta), buf.ctypes.data, crc) + meta)
                _recv_exact(sock, 1)  # decode read and checked it


def serve_in_process(spec: SyntheticSpec, conn) -> None:
    """Entry point of the spawned helper: sends (grpc port, bare port), or the reason NIXL did
    not start, then serves until anything arrives on conn. UCX's settings are inherited."""
    from common.server.grpc_server import run_async

    if spec.torch_threads > 0:
        torch.set_num_threads(spec.torch_threads)
    run_async(lambda: _serve(spec, conn))
