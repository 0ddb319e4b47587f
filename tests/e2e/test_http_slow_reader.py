"""A streaming HTTP client that stops reading, through real services: decode holds about
--http-stream-buffer-bytes for it, then its writes wait; after --http-slow-reader-s of waiting
the request is cut off (`client_too_slow`, `request_cancelled`, never `request_finished`) and
decode's pages are back at baseline (GetStats) while the client still holds its connection.
Both limits are set small here so that a tiny model's stream fills them; nothing is timed:
the test waits for the log lines and the pool, each with a generous bound."""

from __future__ import annotations

import json
import socket

import grpc
import pytest

from common.pb.kvhandoff.v1 import stats_pb2, stats_pb2_grpc
from tests.helpers.checkpoints import make_chat_checkpoint
from tests.helpers.cluster import start_cluster
from tests.helpers.polling import wait_until
from tests.ops.helpers import log_events

pytestmark = pytest.mark.slow

TOKEN = "slow-reader-token"
# a long checkpoint path: every SSE chunk names the model, so each token costs ~0.5 KB
LONG_NAME = "m" * 200


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("slow")
    path, _, _ = make_chat_checkpoint(root / LONG_NAME)
    cluster = start_cluster(root / "run", str(path), decode_flags=[
        "--http-port", "0", "--api-token", TOKEN, "--http-slow-reader-s", "1",
        "--http-stream-buffer-bytes", "16384"], common_flags=[
        "--dtype", "float32", "--page-size", "16", "--pool-tokens", "4096"])
    port = next(int(e["http_port"]) for e in log_events(cluster.decode)
                if e.get("event") == "listening")
    yield cluster, port, str(path)
    cluster.stop()


def _decode_pool(cluster):
    with grpc.insecure_channel(cluster.decode.address) as channel:
        return stats_pb2_grpc.StatsServiceStub(channel).GetStats(
            stats_pb2.GetStatsRequest(), timeout=10,
            metadata=[("authorization", f"Bearer {TOKEN}")]).pool


def _events(cluster, request_id: str) -> list[str]:
    return [e["event"] for e in log_events(cluster.decode) if e.get("request_id") == request_id]


def _open_stream(port: int, model: str) -> tuple[socket.socket, str]:
    """A streamed completion on a socket with a small receive buffer; reads the response head
    and returns (the socket, unread from now on, and the request id decode named)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.connect(("127.0.0.1", port))
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 960,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n"
                 + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                 + body)
    head = b""
    while b"\r\n\r\n" not in head:
        data = sock.recv(1)
        assert data, "decode closed the connection before answering"
        head += data
    assert head.startswith(b"HTTP/1.1 200"), head
    request_id = next(line.split(b":", 1)[1].strip().decode()
                      for line in head.split(b"\r\n") if line.lower().startswith(b"x-request-id"))
    return sock, request_id


def test_a_client_that_stops_reading_is_cut_off_and_its_pages_freed(served):
    cluster, port, model = served
    baseline = _decode_pool(cluster)
    assert baseline.pages_free == baseline.pages_total
    sock, request_id = _open_stream(port, model)
    try:
        wait_until(lambda: "request_cancelled" in _events(cluster, request_id), 120,
                   lambda: f"the unread stream cut off; its events: {_events(cluster, request_id)}")
        events = _events(cluster, request_id)
        assert "client_too_slow" in events and "request_finished" not in events
        wait_until(lambda: _decode_pool(cluster).pages_free == baseline.pages_total, 10,
                   lambda: f"decode's pool back at baseline: {_decode_pool(cluster)}")
    finally:
        sock.close()
