"""`kvhandoff generate`: stream a generation from decode; exit non-zero on a gRPC error."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import grpc

from common.errors import error_reason
from common.pb.kvhandoff.v1 import common_pb2, generate_pb2, generate_pb2_grpc

FINISH_NAMES = {generate_pb2.FINISH_REASON_STOP: "stop",
                generate_pb2.FINISH_REASON_LENGTH: "length"}


def build_request(args: argparse.Namespace) -> generate_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                         top_k=args.top_k, seed=args.seed or 0,
                                         has_seed=args.seed is not None)
    request = generate_pb2.GenerateRequest(
        max_tokens=args.max_tokens, sampling=sampling, ignore_eos=args.ignore_eos,
        stop_token_ids=[int(t) for t in args.stop_token_ids.split(",") if t],
        stop=getattr(args, "stop", None) or [])
    if args.token_ids is not None:
        request.token_ids.ids.extend(int(t) for t in args.token_ids.split(",") if t.strip())
    elif _chat_messages(args):
        request.messages.messages.extend(
            generate_pb2.ChatMessage(role=role, content=content)
            for role, content in _chat_messages(args))
    else:
        request.text = args.prompt
    return request


def _chat_messages(args: argparse.Namespace) -> list[tuple[str, str]]:
    """--system / --user, or --chat (PROMPT is the user's message); [] for a plain prompt."""
    user = getattr(args, "user", None) or (args.prompt if getattr(args, "chat", False) else None)
    if user is None:
        return []
    system = getattr(args, "system", None)
    return ([("system", system)] if system else []) + [("user", user)]


async def _stream(args: argparse.Namespace) -> int:
    if args.tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(args.tls_ca).read_bytes())
        channel = grpc.aio.secure_channel(args.target, creds)
    else:
        channel = grpc.aio.insecure_channel(args.target)
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else None
    stub = generate_pb2_grpc.GenerationServiceStub(channel)
    token_ids: list[int] = []
    try:
        async for response in stub.Generate(build_request(args), timeout=args.timeout,
                                            metadata=metadata):
            if response.HasField("token"):
                token_ids.append(response.token.token_id)
                if args.json:
                    print(json.dumps({"token_id": response.token.token_id,
                                      "text": response.token.text}), flush=True)
                else:
                    print(response.token.text, end="", flush=True)
            else:
                done = response.finished
                if done.text:  # the tail held back until the end
                    print(json.dumps({"text": done.text}) if args.json else done.text,
                          end="\n" if args.json else "", flush=True)
                summary = {"token_ids": token_ids, "finish_reason": FINISH_NAMES.get(
                    done.finish_reason, "unspecified"), "prompt_tokens": done.usage.prompt_tokens,
                    "completion_tokens": done.usage.completion_tokens,
                    "request_id": done.request_id}
                print(json.dumps(summary) if args.json else "", flush=True)
        return 0
    except grpc.aio.AioRpcError as err:
        reason = error_reason(err)
        print(f"\nerror: {err.code().name}: {err.details()}"
              + (f" (reason {reason})" if reason else ""), file=sys.stderr)
        return 1
    finally:
        await channel.close()


def generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvhandoff generate",
                                     description="Stream a generation from a decode service.")
    parser.add_argument("prompt", nargs="?", default=None, help="prompt text")
    parser.add_argument("--token-ids", help="comma-separated prompt token ids instead of text")
    parser.add_argument("--target", default="127.0.0.1:50051", help="decode address")
    parser.add_argument("--max-tokens", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop-token-ids", default="")
    parser.add_argument("--stop", action="append", default=[],
                        help="a stop string (repeat for several)")
    parser.add_argument("--chat", action="store_true",
                        help="send PROMPT as a user message through the model's chat template")
    parser.add_argument("--system", default=None, help="a system message (chat)")
    parser.add_argument("--user", default=None, help="the user message (chat; implies --chat)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--token", default="", help="bearer token for the API")
    parser.add_argument("--tls-ca", default="", help="CA to verify a TLS API")
    parser.add_argument("--wait", type=float, default=0.0,
                        help="first wait up to this many seconds for the target to be SERVING")
    args = parser.parse_args(argv)
    given = [args.prompt is not None, args.token_ids is not None, args.user is not None]
    if sum(given) != 1:
        parser.error("give one of PROMPT, --token-ids or --user")
    if args.system is not None and not (args.chat or args.user is not None):
        parser.error("--system needs --chat or --user")
    if args.wait > 0 and not _wait_serving(args.target, args.wait, args.tls_ca):
        print(f"error: {args.target} was not SERVING within {args.wait}s", file=sys.stderr)
        return 1
    return asyncio.run(_stream(args))


def _wait_serving(target: str, seconds: float, tls_ca: str) -> bool:
    import time

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + seconds
    creds = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes()) if tls_ca else None
    with (grpc.secure_channel(target, creds) if creds else grpc.insecure_channel(target)) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    return False
