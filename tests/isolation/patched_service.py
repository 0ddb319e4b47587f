"""Runs a real kvhandoff service (`python -m tests.isolation.patched_service prefill ...`) with
test-only misbehaviour switched on by environment variables, then `kvhandoff_cli.main.main`:

- KVH_TEST_CORRUPT_MARKER=N  (prefill) every chunk of a prompt whose first token is N goes out
  with a wrong crc32c, as a bit flip on the wire would;
- KVH_TEST_SLOW_PREFILL_MARKER=N  (prefill) after each chunk of such a prompt the engine thread
  sleeps KVH_TEST_SLOW_SECONDS, so a handoff is still streaming when a test acts;
- KVH_TEST_SLOW_DECODE_MARKER=N  (decode) after each token of such a prompt the engine thread
  sleeps KVH_TEST_SLOW_SECONDS, so a generation is still running when a test acts.

Only the public `submit` / `begin` of the engines are wrapped; every other byte is our code.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from kvhandoff_cli.main import main
from common.pb.kvhandoff.v1 import handoff_pb2
from decode_svc.engine import DecodeEngine
from decode_svc.sequence import TokenEvent
from prefill_svc.engine import PrefillEngine, PrefillJob


def _marker(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value else None


def _message(frame) -> handoff_pb2.PrefillResponse | None:
    """The frame as a message: the engine emits serialized frames (bytes) or messages."""
    if frame is None or isinstance(frame, handoff_pb2.PrefillResponse):
        return frame
    return handoff_pb2.PrefillResponse.FromString(bytes(frame))


def _is_chunk(frame) -> bool:
    message = _message(frame)
    return message is not None and message.HasField("chunk")


def _corrupting(emit: Callable) -> Callable:
    def emit_corrupted(frame) -> None:
        message = _message(frame)
        if message is not None and message.HasField("chunk"):
            message.chunk.crc32c ^= 0x1
            frame = message if frame is message else message.SerializeToString()
        emit(frame)
    return emit_corrupted


def _slowed(emit: Callable, seconds: float, is_slow_point: Callable) -> Callable:
    def emit_slowly(item) -> None:
        emit(item)
        if is_slow_point(item):
            time.sleep(seconds)
    return emit_slowly


def install() -> None:
    corrupt = _marker("KVH_TEST_CORRUPT_MARKER")
    slow_prefill = _marker("KVH_TEST_SLOW_PREFILL_MARKER")
    slow_decode = _marker("KVH_TEST_SLOW_DECODE_MARKER")
    seconds = float(os.environ.get("KVH_TEST_SLOW_SECONDS", "1.0"))
    submit, begin = PrefillEngine.submit, DecodeEngine.begin

    def patched_submit(self: PrefillEngine, job: PrefillJob) -> None:
        first = job.token_ids[0] if job.token_ids else None
        if corrupt is not None and first == corrupt:
            job.emit = _corrupting(job.emit)
        if slow_prefill is not None and first == slow_prefill:
            job.emit = _slowed(job.emit, seconds, _is_chunk)
        submit(self, job)

    def patched_begin(self: DecodeEngine, seq) -> None:
        if slow_decode is not None and seq.tokens[0] == slow_decode:
            seq.emit = _slowed(seq.emit, seconds, lambda event: isinstance(event, TokenEvent))
        begin(self, seq)

    PrefillEngine.submit = patched_submit
    DecodeEngine.begin = patched_begin


if __name__ == "__main__":
    install()
    sys.exit(main(sys.argv[1:]))
