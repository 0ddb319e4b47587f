"""The bare transports `kvhandoff bench transfer` compares the services with: decode's half of
each (the senders run in the synthetic prefill process, bench/synthetic_prefill.py).

- raw TCP: ask for N bytes, recv_into one buffer until all arrived;
- bare gRPC: one unary-stream call on the handoff's own server, N bytes as 4 MiB `bytes`
  messages (receive limit raised), each received message counted, nothing parsed or checked;
- bare shared memory: a 0600 region, 4 MiB pieces announced over a socket, each pread into
  decode's buffer as soon as it is announced.
Each returns (seconds, bytes moved), timed from the request to the last byte in decode's hands.
"""

from __future__ import annotations

import socket
import time

import grpc

from bench.synthetic_prefill import (BARE_GRPC_METHOD, BARE_GRPC_PIECE_BYTES, SHM_PIECE,
                                     SIZE_HEADER)
from common.handoff.planes import DEFAULT_SHM_DIR
from common.handoff.shm_region import RegionReader


def socket_receive(sock: socket.socket, size: int, buffer: bytearray) -> tuple[float, int]:
    started = time.perf_counter()
    sock.sendall(SIZE_HEADER.pack(size))
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:size])
        if n == 0:
            raise ConnectionError("the socket sender closed early")
        got += n
    return time.perf_counter() - started, got


class BareGrpc:
    """A channel with the receive limit raised to one piece plus framing."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", BARE_GRPC_PIECE_BYTES + (64 << 10)),
            ("grpc.http2.max_frame_size", (1 << 24) - 1)])
        self.call = self.channel.unary_stream(BARE_GRPC_METHOD)

    async def receive(self, size: int) -> tuple[float, int]:
        started = time.perf_counter()
        got = 0
        async for piece in self.call(SIZE_HEADER.pack(size), timeout=600):
            got += len(piece)
        return time.perf_counter() - started, got

    async def close(self) -> None:
        await self.channel.close()


def shm_receive(sock: socket.socket, size: int, buffer: bytearray) -> tuple[float, int]:
    """Ask for size bytes, pread each announced piece into buffer (decode's own memory) as
    soon as it is written; the zero-length piece ends it, and decode's ack lets prefill unlink."""
    started = time.perf_counter()
    sock.sendall(SIZE_HEADER.pack(size))
    view = memoryview(buffer)
    reader = None
    got = 0
    try:
        while True:
            name, offset, n = SHM_PIECE.unpack(_recv_all(sock, SHM_PIECE.size))
            if n == 0:
                break
            if reader is None:
                reader = RegionReader(DEFAULT_SHM_DIR, "kvh-" + name.decode())
            reader.read_into(offset, view[offset:offset + n])
            got += n
        return time.perf_counter() - started, got
    finally:
        if reader is not None:
            reader.close()
        sock.sendall(b"\x01")


def _recv_all(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        part = sock.recv(size - len(data))
        if not part:
            raise ConnectionError("the shared-memory sender closed early")
        data += part
    return bytes(data)
