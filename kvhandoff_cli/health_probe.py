"""`python -m kvhandoff_cli.health_probe HOST:PORT`: one grpc.health.v1 Check, for healthchecks.

Exit status 0 when the server answers SERVING, 1 for anything else (NOT_SERVING, an unknown
service, no answer within --timeout), 2 for bad arguments. Prints one line saying which.
Imports only grpc, never torch, so a container healthcheck costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


def _channel(target: str, args: argparse.Namespace) -> grpc.Channel:
    if not (args.tls_ca or args.tls_cert):
        return grpc.insecure_channel(target)
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(args.tls_ca).read_bytes() if args.tls_ca else None,
        private_key=Path(args.tls_key).read_bytes() if args.tls_key else None,
        certificate_chain=Path(args.tls_cert).read_bytes() if args.tls_cert else None)
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    return grpc.secure_channel(target, creds, options)


def check(target: str, service: str = "", timeout: float = 3.0,
          args: argparse.Namespace | None = None) -> str:
    """The health status name of `service` at target, or 'UNREACHABLE (<code>)'."""
    args = args or argparse.Namespace(tls_ca="", tls_cert="", tls_key="", server_name="")
    with _channel(target, args) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout,
                wait_for_ready=False)
        except grpc.RpcError as err:
            return f"UNREACHABLE ({err.code().name})"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvhandoff_cli.health_probe",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("target", help="HOST:PORT of a kvhandoff service")
    parser.add_argument("--service", default="", help="service name to check (default: the "
                        "whole server, which kvhandoff keeps in step with every service)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer")
    parser.add_argument("--tls-ca", default="", help="PEM CA to verify a TLS server")
    parser.add_argument("--tls-cert", default="", help="PEM client certificate (mTLS)")
    parser.add_argument("--tls-key", default="", help="PEM key for --tls-cert")
    parser.add_argument("--server-name", default="", help="expected name in the server's cert")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error("--timeout must be > 0")
    status = check(args.target, args.service, args.timeout, args)
    print(f"{args.target} {args.service or '(server)'} {status}", flush=True)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
