"""`kvhandoff generate`: stream a generation from decode; exit non-zero on a gRPC error."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc

from common.errors import error_reason
from common.pb.kvhandoff.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from common.server.wait import CHECK_TIMEOUT_SECONDS, wait_serving
from kvhandoff_cli.arguments import (HelpFormatter, count, non_negative, positive_seconds,
                                     probability, seed, target, token_ids)
from kvhandoff_cli.client_tls import TlsFileError, explain_unreachable, read_pem

FINISH_NAMES = {generate_pb2.FINISH_REASON_STOP: "stop",
                generate_pb2.FINISH_REASON_LENGTH: "length"}


def build_request(args: argparse.Namespace) -> generate_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                         top_k=args.top_k, seed=args.seed or 0,
                                         has_seed=args.seed is not None)
    request = generate_pb2.GenerateRequest(
        max_tokens=args.max_tokens, sampling=sampling, ignore_eos=args.ignore_eos,
        stop_token_ids=args.stop_token_ids, stop=args.stop)
    if args.token_ids is not None:
        request.token_ids.ids.extend(args.token_ids)
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


class Output:
    """Where the stream and its errors go: text, or with --json one JSON object per line
    (an error too: {"error": {"code", "message", "reason"}}, on stdout after the tokens)."""

    def __init__(self, json_lines: bool) -> None:
        self.json = json_lines
        self.mid_line = False  # text tokens printed without a newline yet

    def text(self, piece: str) -> None:
        print(piece, end="", flush=True)
        self.mid_line = self.mid_line or bool(piece)

    def error(self, message: str, code: str = "", reason: str = "") -> None:
        if self.json:
            print(json.dumps({"error": {"code": code, "message": message, "reason": reason}}),
                  flush=True)
            return
        if self.mid_line:  # end the streamed text's line, so the error is a line of its own
            print(flush=True)
            self.mid_line = False
        prefix = f"error: {code}: " if code else "error: "
        print(prefix + message + (f" (reason {reason})" if reason else ""), file=sys.stderr,
              flush=True)


def _credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    if not args.tls_ca:
        return None
    return grpc.ssl_channel_credentials(root_certificates=read_pem(args.tls_ca, "--tls-ca"))


async def _stream(args: argparse.Namespace, out: Output) -> int:
    creds = _credentials(args)
    if creds is not None:
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
                    out.text(response.token.text)
            else:
                done = response.finished
                if done.text:  # the tail held back until the end
                    if args.json:
                        print(json.dumps({"text": done.text}), flush=True)
                    else:
                        out.text(done.text)
                summary = {"token_ids": token_ids, "finish_reason": FINISH_NAMES.get(
                    done.finish_reason, "unspecified"), "prompt_tokens": done.usage.prompt_tokens,
                    "completion_tokens": done.usage.completion_tokens,
                    "request_id": done.request_id}
                print(json.dumps(summary) if args.json else "", flush=True)
                out.mid_line = False
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # Ctrl-C landed in grpc's read, which can
            raise asyncio.CancelledError  # end the stream quietly: still a cancelled call
        return 0
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.UNIMPLEMENTED and await _is_prefill(channel):
            out.error(f"{args.target} is a kvhandoff prefill (it serves HandoffService), not a "
                      f"decode; point --target at the decode service (port 50051 by default)",
                      err.code().name)
            return 1
        details, reason = err.details() or "", error_reason(err) or ""
        if err.code() == grpc.StatusCode.UNAVAILABLE and not reason and _connection_lost(details):
            out.error(_lost_message(args.target, len(token_ids), details), err.code().name,
                      "CONNECTION_LOST")
            return 1
        if err.code() == grpc.StatusCode.UNAVAILABLE:
            details = explain_unreachable(details, args.target, args.tls_ca) or details
        out.error(details, err.code().name, reason)
        return 1
    finally:
        await channel.close()


# what gRPC says when an established connection ends under a call (the server process died,
# or something between reset the connection), as opposed to a server's own UNAVAILABLE answer
LOST_CONNECTION_DETAILS = ("Socket closed", "Stream removed", "Connection reset by peer",
                           "Broken pipe", "GOAWAY")


def _connection_lost(details: str) -> bool:
    return any(marker in details for marker in LOST_CONNECTION_DETAILS)


def _lost_message(target: str, num_tokens: int, details: str) -> str:
    """A connection that broke mid-call, said as what happened and what to do."""
    when = (f"after {num_tokens} token{'s' if num_tokens != 1 else ''} (the text above is "
            f"incomplete)" if num_tokens else "before the first token")
    return (f"the connection to {target} was lost {when}: the decode service stopped or "
            f"crashed mid-request (gRPC: {details}); retry the request, on another replica if "
            f"there is one")


def _tls_reason(args: argparse.Namespace) -> str | None:
    """Why the server never answered when the reason is TLS (wait_serving only sees the code):
    one health Check that does not wait, read by the TLS diagnosis; None otherwise."""
    from kvhandoff_cli.health_probe import check

    probe = argparse.Namespace(tls_ca=args.tls_ca, tls_cert="", tls_key="", server_name="")
    status = check(args.target, timeout=CHECK_TIMEOUT_SECONDS, args=probe)
    return status.partition(": ")[2] if status.startswith("TLS_FAILED") else None


async def _is_prefill(channel: grpc.aio.Channel) -> bool:
    """Whether the server behind channel knows prefill's HandoffService (asked through the
    standard health service, which every kvhandoff service runs)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="kvhandoff.v1.HandoffService"), timeout=5)
    except grpc.aio.AioRpcError:
        return False
    return True


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvhandoff generate", formatter_class=HelpFormatter,
                                description="Stream a generation from a decode service: the "
                                "text as it arrives (or, with --json, one JSON object per "
                                "token and a summary). Exit status 1 on a gRPC error.")
    p.add_argument("prompt", nargs="?", default=None,
                   help="prompt text (the demo model's tokenizer is one id per character)")
    p.add_argument("--token-ids", type=token_ids,
                   help="comma-separated prompt token ids instead of text, e.g. 5,6,7")
    p.add_argument("--target", type=target, default="127.0.0.1:50051",
                   help="decode address HOST:PORT")
    p.add_argument("--max-tokens", type=count, default=0,
                   help="tokens to generate at most (0: the server's --default-max-tokens)")
    p.add_argument("--temperature", type=non_negative, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=probability, default=1.0,
                   help="nucleus sampling mass in [0, 1] (0 and 1: no cut)")
    p.add_argument("--top-k", type=count, default=0, help="sample from the k likeliest (0: all)")
    p.add_argument("--seed", type=seed, default=None,
                   help="sampling seed, for repeatable samples (none: the server picks one)")
    p.add_argument("--stop-token-ids", type=token_ids, default=[],
                   help="comma-separated ids that end the generation")
    p.add_argument("--stop", action="append", default=[],
                   help="a stop string: the text ends right before it (repeat for several)")
    p.add_argument("--chat", action="store_true",
                   help="send PROMPT as a user message through the model's chat template")
    p.add_argument("--system", default=None, help="a system message (chat)")
    p.add_argument("--user", default=None, help="the user message (chat; implies --chat)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the model's end-of-sequence token")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--timeout", type=positive_seconds, default=None,
                   help="deadline in seconds (none: no deadline)")
    p.add_argument("--token", default="", help="bearer token for the API (--api-token)")
    p.add_argument("--tls-ca", default="", help="PEM CA to verify a TLS API (empty: plaintext)")
    p.add_argument("--wait", type=float, default=0.0,
                   help="first wait up to this many seconds for the target to be SERVING")
    return p


def generate(argv: list[str]) -> int:
    p = parser()
    args = p.parse_args(argv)
    given = sum(x is not None for x in (args.prompt, args.token_ids, args.user))
    if given == 0:
        p.error("give a PROMPT, --token-ids or --user")
    if given > 1:
        p.error("give one of PROMPT, --token-ids or --user, not several")
    if args.system is not None and not (args.chat or args.user is not None):
        p.error("--system needs --chat or --user")
    out = Output(args.json)
    try:
        if args.tls_ca:
            read_pem(args.tls_ca, "--tls-ca")  # a bad file is refused before any wait
        if args.wait > 0:
            try:
                wait_serving(args.target, args.wait, credentials=_credentials(args))
            except TimeoutError as err:
                out.error(_tls_reason(args) or str(err), "UNAVAILABLE")
                return 1
        return asyncio.run(_stream(args, out))
    except TlsFileError as err:  # a usage error, said like argparse's
        if args.json:
            out.error(str(err), "INVALID_ARGUMENT")
        else:
            print(f"kvhandoff generate: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the call is cancelled, which the server logs and counts
        if out.mid_line:
            print(flush=True)
        print("cancelled", file=sys.stderr, flush=True)
        return 130

