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
from common.server.wait import wait_serving

FINISH_NAMES = {generate_pb2.FINISH_REASON_STOP: "stop",
                generate_pb2.FINISH_REASON_LENGTH: "length"}


def build_request(args: argparse.Namespace) -> generate_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                         top_k=args.top_k, seed=args.seed or 0,
                                         has_seed=args.seed is not None)
    request = generate_pb2.GenerateRequest(
        max_tokens=args.max_tokens, sampling=sampling, ignore_eos=args.ignore_eos,
        stop_token_ids=[int(t) for t in args.stop_token_ids.split(",") if t])
    if args.token_ids is not None:
        request.token_ids.ids.extend(int(t) for t in args.token_ids.split(",") if t.strip())
    else:
        request.text = args.prompt
    return request


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
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--token", default="", help="bearer token for the API")
    parser.add_argument("--tls-ca", default="", help="CA to verify a TLS API")
    parser.add_argument("--wait", type=float, default=0.0,
                        help="first wait up to this many seconds for the target to be SERVING")
    args = parser.parse_args(argv)
    if (args.prompt is None) == (args.token_ids is None):
        parser.error("give a PROMPT or --token-ids, not both")
    if args.wait > 0:
        creds = (grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes()) if args.tls_ca
                 else None)
        try:
            wait_serving(args.target, args.wait, credentials=creds)
        except TimeoutError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
    return asyncio.run(_stream(args))

