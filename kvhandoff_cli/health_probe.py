"""`kvhandoff health HOST:PORT` (or `python -m kvhandoff_cli.health_probe HOST:PORT`): one
grpc.health.v1 Check, for healthchecks.

Exit status 0 when the server answers SERVING, 1 for anything else (NOT_SERVING, NOT_FOUND for
a service the server does not know, TLS_FAILED when the TLS handshake failed, UNREACHABLE
when nothing answers within --timeout), 2 for bad arguments (a TLS file that is missing or not
PEM included). Prints one line saying which, and for TLS_FAILED and UNREACHABLE what to
change when gRPC said why. Imports only grpc, never torch, so a
container healthcheck costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":  # a healthcheck's output is its one line: no gRPC core log lines
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import grpc  # noqa: E402 (after the environment gRPC reads when it loads)
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from kvhandoff_cli.arguments import HelpFormatter, positive_seconds, target  # noqa: E402
from kvhandoff_cli.client_tls import (  # noqa: E402
    TlsFileError, explain_unreachable, read_pem, tls_failure)

SERVING = health_pb2.HealthCheckResponse.SERVING


def _channel(target: str, args: argparse.Namespace) -> grpc.Channel:
    if not (args.tls_ca or args.tls_cert):
        return grpc.insecure_channel(target)
    creds = grpc.ssl_channel_credentials(
        root_certificates=read_pem(args.tls_ca, "--tls-ca") if args.tls_ca else None,
        private_key=read_pem(args.tls_key, "--tls-key") if args.tls_key else None,
        certificate_chain=read_pem(args.tls_cert, "--tls-cert") if args.tls_cert else None)
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    return grpc.secure_channel(target, creds, options)


def check(target: str, service: str = "", timeout: float = 3.0,
          args: argparse.Namespace | None = None) -> str:
    """The health status name of `service` at target; NOT_FOUND when the server answered that
    it does not know the service; 'TLS_FAILED (<cause>): <what to change>' when the TLS
    handshake failed (wrong CA, SAN mismatch, a client certificate missing or refused);
    otherwise 'UNREACHABLE (<code>)', followed by what to change when gRPC's details say why
    (a refused connection).
    Raises TlsFileError for a TLS file that is missing or not PEM."""
    args = args or argparse.Namespace(tls_ca="", tls_cert="", tls_key="", server_name="")
    with _channel(target, args) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout,
                wait_for_ready=False)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:  # the server answered: no such service
                return "NOT_FOUND"
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                return f"UNREACHABLE ({err.code().name})"
            details, mtls = err.details() or "", bool(args.tls_cert)
            tls = tls_failure(details, target, args.tls_ca, mtls, args.server_name,
                              "--server-name")
            if tls is not None:  # it answered, but the handshake failed: not "unreachable"
                return f"TLS_FAILED ({tls.cause.value}): {tls.message}"
            why = explain_unreachable(details, target, args.tls_ca, mtls, args.server_name,
                                      "--server-name")
            return f"UNREACHABLE ({err.code().name})" + (f": {why}" if why else "")
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None, prog: str = "python -m kvhandoff_cli.health_probe"
         ) -> int:
    parser = argparse.ArgumentParser(prog=prog, formatter_class=HelpFormatter,
                                     description="Ask a kvhandoff service whether it is SERVING "
                                     "(one grpc.health.v1 Check). "
                                     + __doc__.split("\n\n")[1].replace("\n", " "))
    parser.add_argument("target", type=target, help="HOST:PORT of a kvhandoff service")
    parser.add_argument("--service", default="", help="service name to check (empty: the "
                        "whole server, which kvhandoff keeps in step with every service)")
    parser.add_argument("--timeout", type=positive_seconds, default=3.0,
                        help="seconds to wait for an answer")
    parser.add_argument("--tls-ca", default="", help="PEM CA to verify a TLS server")
    parser.add_argument("--tls-cert", default="", help="PEM client certificate (mTLS)")
    parser.add_argument("--tls-key", default="", help="PEM key for --tls-cert")
    parser.add_argument("--server-name", default="", help="expected name in the server's cert")
    args = parser.parse_args(argv)
    if args.tls_key and not args.tls_cert or args.tls_cert and not args.tls_key:
        parser.error("--tls-cert and --tls-key go together (the client certificate and its key)")
    try:
        status = check(args.target, args.service, args.timeout, args)
    except TlsFileError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    print(f"{args.target} {args.service or '(server)'} {status}", flush=True)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
