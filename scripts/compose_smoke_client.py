"""The host side of scripts/compose_smoke.sh: talks to the compose cluster through decode's
published port on 127.0.0.1 (and nothing else), with the project's own generated stubs.

  python scripts/compose_smoke_client.py stream --target 127.0.0.1:PORT --max-tokens 32
  python scripts/compose_smoke_client.py drain --target 127.0.0.1:PORT --requests 4 \
      --max-tokens 400 -- docker compose ... stop

`stream` runs one generation and checks it streamed every token it promised. `drain` starts
N streaming generations (ignore_eos, so each must produce exactly max_tokens), waits until
every one has its first token, runs the stop command, and checks that each stream still
finished with finish_reason LENGTH and all its tokens, and that the stop command returned
within --grace seconds. Prints one JSON line; exit status 0 only when every check held.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.pb.kvhandoff.v1 import generate_pb2, generate_pb2_grpc

LENGTH = generate_pb2.FINISH_REASON_LENGTH
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


@dataclass
class Stream:
    """One generation as the client saw it; times are time.time() (same clock as the logs)."""

    tokens: int = 0
    indices_in_order: bool = True
    finish_reason: str = ""
    completion_tokens: int = 0
    error: str = ""
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    first: threading.Event = field(default_factory=threading.Event, repr=False)


def run_stream(target: str, max_tokens: int, out: Stream, timeout: float,
               prompt: list[int] | None = None) -> None:
    """One streaming generation into `out` (never raises: a gRPC error lands in out.error)."""
    request = generate_pb2.GenerateRequest(max_tokens=max_tokens, ignore_eos=True)
    request.token_ids.ids.extend(prompt or PROMPT)
    try:
        with grpc.insecure_channel(target) as channel:
            stub = generate_pb2_grpc.GenerationServiceStub(channel)
            for reply in stub.Generate(request, timeout=timeout, wait_for_ready=True):
                if reply.HasField("token"):
                    out.indices_in_order &= reply.token.index == out.tokens
                    out.tokens += 1
                    out.last_token_at = time.time()
                    if out.tokens == 1:
                        out.first_token_at = out.last_token_at
                        out.first.set()
                else:
                    out.finish_reason = generate_pb2.FinishReason.Name(
                        reply.finished.finish_reason)
                    out.completion_tokens = reply.finished.usage.completion_tokens
    except grpc.RpcError as err:
        out.error = f"{err.code().name}: {err.details()}"
    finally:
        out.first.set()


def complete(stream: Stream, max_tokens: int) -> list[str]:
    """What is wrong with a stream that should have delivered max_tokens tokens."""
    problems = []
    if stream.error:
        problems.append(stream.error)
    if stream.finish_reason != generate_pb2.FinishReason.Name(LENGTH):
        problems.append(f"finish_reason {stream.finish_reason or 'missing'}")
    if not stream.tokens == stream.completion_tokens == max_tokens:
        problems.append(f"{stream.tokens} tokens streamed, usage says "
                        f"{stream.completion_tokens}, asked for {max_tokens}")
    if not stream.indices_in_order:
        problems.append("token indices out of order")
    return problems


def cmd_stream(args: argparse.Namespace) -> int:
    stream = Stream()
    started = time.monotonic()
    run_stream(args.target, args.max_tokens, stream, args.timeout)
    problems = complete(stream, args.max_tokens)
    print(json.dumps({"check": "stream", "ok": not problems, "problems": problems,
                      "seconds": round(time.monotonic() - started, 2),
                      **{f.name: getattr(stream, f.name) for f in fields(stream)
                         if f.name != "first"}}))
    return 0 if not problems else 1


def cmd_drain(args: argparse.Namespace) -> int:
    streams = [Stream() for _ in range(args.requests)]
    threads = [threading.Thread(target=run_stream, daemon=True,
                                args=(args.target, args.max_tokens, s, args.timeout))
               for s in streams]
    for thread in threads:
        thread.start()
    for stream in streams:
        stream.first.wait(args.timeout)
    problems = [f"request {i}: no first token ({s.error or 'timeout'})"
                for i, s in enumerate(streams) if not s.tokens]
    stop_at = time.time()
    stop = subprocess.run(args.stop_command, check=False, capture_output=True, text=True,
                          timeout=args.grace + 30)
    stop_seconds = time.time() - stop_at
    for thread in threads:
        thread.join(args.timeout)
    if stop.returncode != 0:
        problems.append(f"stop command exited {stop.returncode}: {stop.stderr.strip()[-300:]}")
    if stop_seconds >= args.grace:
        problems.append(f"stop took {stop_seconds:.1f} s, not under the {args.grace} s grace")
    for i, stream in enumerate(streams):
        problems += [f"request {i}: {p}" for p in complete(stream, args.max_tokens)]
        # Tokens after the stop began: the request really was in flight during the drain.
        if stream.last_token_at <= stop_at:
            problems.append(f"request {i} finished before the stop began (raise --max-tokens)")
    print(json.dumps({
        "check": "drain", "ok": not problems, "problems": problems, "requests": args.requests,
        "max_tokens": args.max_tokens, "stop_began_at": stop_at,
        "stop_seconds": round(stop_seconds, 2),
        "tokens_after_stop_began": [0 if s.last_token_at <= stop_at else
                                    round(s.last_token_at - stop_at, 2) for s in streams],
        "tokens": [s.tokens for s in streams],
        "finish_reasons": [s.finish_reason for s in streams]}))
    return 0 if not problems else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("stream", "drain"):
        p = sub.add_parser(name)
        p.add_argument("--target", required=True, help="decode's published HOST:PORT")
        p.add_argument("--max-tokens", type=int, default=32)
        p.add_argument("--timeout", type=float, default=120.0, help="seconds per generation")
    drain = sub.choices["drain"]
    drain.add_argument("--requests", type=int, default=4)
    drain.add_argument("--grace", type=float, default=50.0,
                       help="the stop must return within this (compose stop_grace_period)")
    drain.add_argument("stop_command", nargs="+", help="after --: the command that stops")
    args = parser.parse_args(argv)
    if args.max_tokens < 1 or (args.command == "drain" and args.requests < 1):
        parser.error("--max-tokens and --requests must be >= 1")
    return cmd_stream(args) if args.command == "stream" else cmd_drain(args)


if __name__ == "__main__":
    sys.exit(main())
