"""`kvhandoff`: run the services, a local cluster, a client, the conformance suite, benchmarks.

Every command module is imported only when it runs, so `kvhandoff generate` and `kvhandoff
health` start without importing torch (the service settings import it through common.config).
gRPC's C core writes log lines of its own to stderr (a TLS handshake that failed, a CA file it
cannot load) ahead of the one line a command prints; they stay off unless `--verbose` is given
or GRPC_VERBOSITY is set, so it is set before anything imports grpc.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from kvhandoff_cli.arguments import HelpFormatter

ROLE_TEXT = {"prefill": "Run the prefill service: it computes prompts' KV and hands it to "
                        "decode over kvhandoff.v1.HandoffService.",
             "decode": "Run the decode service, the client-facing front door: it pulls each "
                       "prompt's KV from prefill (--prefill) and streams tokens."}


def _service_parser(role: str) -> argparse.ArgumentParser:
    from kvhandoff_cli.settings import add_service_flags

    parser = argparse.ArgumentParser(prog=f"kvhandoff {role}", description=ROLE_TEXT[role],
                                     formatter_class=HelpFormatter)
    add_service_flags(parser, role)
    return parser


def _prepare_kernels_env(kernels: str, device: str) -> None:
    """Triton on a machine without CUDA runs through its interpreter; it must be set before
    triton is imported."""
    if kernels == "triton":
        import torch

        if device == "cpu" or not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")


def _check_ports(service) -> None:
    """Refuses, before the model is loaded, ports that are already taken (PortUnavailable)."""
    from common.server.ports import check_port_free

    check_port_free(service.host, service.port, "--port")
    if service.metrics_port > 0:
        check_port_free(service.host, service.metrics_port, "--metrics-port")


# Flags whose empty value would quietly turn a protection off (`--api-token "$TOKEN"` with
# TOKEN unset runs the client API without a token): given empty on the command line, refused.
NOT_EMPTY = ("--api-token",)


def _given_empty(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        for flag in NOT_EMPTY:
            if arg == f"{flag}=" or arg == flag and i + 1 < len(argv) and argv[i + 1] == "":
                return flag
    return None


def run_service(role: str, argv: list[str]) -> int:
    from kvhandoff_cli.settings import apply_sources, build_config

    if flag := _given_empty(argv):
        print(f"kvhandoff {role}: refusing to start: {flag} is empty (an unset shell "
              f"variable?), which would run the client API without a token; give the token, "
              f"or leave {flag} out to run without one", file=sys.stderr)
        return 2
    parser = _service_parser(role)
    ns = apply_sources(parser, argv, role)
    try:
        config = build_config(ns, role)
    except ValueError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    from common.server.ports import PortUnavailable

    try:
        _check_ports(config.service)
    except PortUnavailable as err:
        print(f"kvhandoff {role}: refusing to start: {err}", file=sys.stderr)
        return 2
    from kvhandoff_cli.device_check import device_problem

    if problem := device_problem(config.service.device):
        print(f"kvhandoff {role}: refusing to start: {problem}", file=sys.stderr)
        return 2
    _prepare_kernels_env(config.service.kernels, config.service.device)
    from common.capacity import CapacityError
    from common.model.config import UnsupportedModelError

    try:
        if role == "prefill":
            from prefill_svc.server import serve
        else:
            from decode_svc.server import serve
        serve(config, port_file=ns.port_file)
    except (CapacityError, UnsupportedModelError, FileNotFoundError, ValueError,
            PortUnavailable) as err:
        print(f"kvhandoff {role}: refusing to start: {err}", file=sys.stderr)
        return 2
    return 0


def config_show(argv: list[str]) -> int:
    from kvhandoff_cli.settings import apply_sources, build_config, redacted

    parser = argparse.ArgumentParser(prog="kvhandoff config show", formatter_class=HelpFormatter,
                                     description="Print the effective configuration of a role "
                                     "as JSON, after the file, the environment and the flags, "
                                     "without starting anything. Secrets are redacted.")
    parser.add_argument("role", choices=["prefill", "decode"], help="the service to show")
    role = parser.parse_known_args(argv)[0].role
    service_parser = _service_parser(role)
    ns = apply_sources(service_parser, argv[1:], role)
    try:
        config = build_config(ns, role)
    except ValueError as err:
        service_parser.exit(2, f"{service_parser.prog}: error: {err}\n")
    print(json.dumps(redacted(dataclasses.asdict(config)), indent=2))
    return 0


COMMANDS = {
    "up": "Start prefill and decode on loopback; print 'ready' with the address.",
    "prefill": "Run the prefill service.",
    "decode": "Run the decode service (--prefill HOST:PORT).",
    "generate": "Stream a generation from a decode service.",
    "config": "config show prefill|decode: print the effective configuration.",
    "health": "health HOST:PORT: exit 0 when the service's grpc.health.v1 says SERVING.",
    "conformance": "conformance prefill|decode: check an implementation of kvhandoff.v1.",
    "bench": "bench BENCHMARK: benchmarks (kvhandoff bench --help lists them).",
}
CONFIG_USAGE = "usage: kvhandoff config show prefill|decode [flags]"
CONFIG_TEXT = ("Print the effective configuration of a role as JSON, after the file, the "
               "environment and the flags, without starting anything (kvhandoff config show "
               "prefill --help lists the flags).")


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("kvhandoff")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def usage() -> str:
    from bench.cli import BENCHMARKS  # names only: the benchmarks load when one runs

    texts = {**COMMANDS, "bench": f"bench {'|'.join(BENCHMARKS)}: benchmarks."}
    lines = [f"  {name:<12} {text}" for name, text in texts.items()]
    return ("usage: kvhandoff [--verbose] COMMAND [options]   (kvhandoff COMMAND --help)\n"
            "       kvhandoff --version\n\ncommands:\n" + "\n".join(lines)
            + "\n\n--verbose (anywhere on the line) keeps gRPC's own log lines on stderr.")


def quiet_grpc(argv: list[str]) -> list[str]:
    """argv without --verbose; without it, gRPC's C-core logging is turned off for this
    process and the services it starts (unless GRPC_VERBOSITY is already set)."""
    if "--verbose" in argv:
        return [arg for arg in argv if arg != "--verbose"]
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    return argv


def main(argv: list[str] | None = None) -> int:
    argv = quiet_grpc(list(sys.argv[1:] if argv is None else argv))
    if argv and argv[0] in ("-V", "--version"):
        print(f"kvhandoff {version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"kvhandoff: unknown command {argv[0]!r}; one of: {', '.join(COMMANDS)} "
                  f"(kvhandoff --help)", file=sys.stderr)
            return 2
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command in ("prefill", "decode"):
        return run_service(command, rest)
    if command == "up":
        from kvhandoff_cli.up import up

        return up(rest)
    if command == "generate":
        from kvhandoff_cli.generate import generate

        return generate(rest)
    if command == "config":
        if rest and rest[0] in ("-h", "--help"):
            print(f"{CONFIG_USAGE}\n\n{CONFIG_TEXT}")
            return 0
        if not rest or rest[0] != "show":
            given = f"unknown subcommand {rest[0]!r}" if rest else "no subcommand"
            print(f"kvhandoff config: {given}; {CONFIG_USAGE.removeprefix('usage: ')}",
                  file=sys.stderr)
            return 2
        return config_show(rest[1:])
    if command == "health":
        from kvhandoff_cli.health_probe import main as probe

        return probe(rest, prog="kvhandoff health")
    if command == "conformance":
        from conformance.cli import main as conformance_main

        return conformance_main(rest)
    from bench.cli import main as bench_main

    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
