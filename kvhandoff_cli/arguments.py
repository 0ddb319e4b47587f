"""Argument types and checks shared by the client commands (generate, health).

Each type raises argparse.ArgumentTypeError with a message that names what was wrong, so bad
input ends with argparse's one-line usage error (exit status 2), never a traceback. Imports
nothing heavy: `kvhandoff generate` and `kvhandoff health` must start without torch.
"""

from __future__ import annotations

import argparse
import math
import re

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
# gRPC target schemes that carry their own address syntax (no HOST:PORT check applies).
SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")
HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^:\[\]/\s]+):(\d{1,5})")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, once: a help text that shows it already
    (`%(default)s`) gets no second one, and an unset default reads `none` or `empty` rather
    than Python's `None` or nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return text if "%(default)" in text else super()._get_help_string(action)

    def _expand_help(self, action: argparse.Action) -> str:
        if action.default is None or action.default == "":
            action = argparse.Action(action.option_strings, action.dest, help=action.help,
                                     default="none" if action.default is None else "empty",
                                     metavar=action.metavar, choices=action.choices,
                                     type=action.type, nargs=action.nargs)
        return super()._expand_help(action)


def _integer(text: str, what: str, high: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not 0 <= value <= high:
        raise argparse.ArgumentTypeError(f"{value} is not {what}")
    return value


def count(text: str) -> int:
    """A non-negative integer that fits the protocol's uint32 fields (max_tokens, top_k)."""
    return _integer(text, f"a whole number in [0, {UINT32_MAX}]", UINT32_MAX)


def seed(text: str) -> int:
    return _integer(text, f"a seed in [0, {UINT64_MAX}]", UINT64_MAX)


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0 seconds")
    return value


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not {what}")
    return value


def non_negative(text: str) -> float:
    """A finite number >= 0 (temperature)."""
    value = _number(text, "a number >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number >= 0")
    return value


def probability(text: str) -> float:
    """A number in [0, 1] (top_p: 0 and 1 both mean no cut, as in the protocol)."""
    value = _number(text, "a number in [0, 1]")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not a number in [0, 1]")
    return value


def token_ids(text: str) -> list[int]:
    """Comma-separated token ids, e.g. "1,2,3" (spaces and a trailing comma are fine)."""
    return [_integer(part, "a token id (a whole number >= 0)", UINT32_MAX)
            for part in text.split(",") if part.strip()]


def target(text: str) -> str:
    """HOST:PORT, [IPv6]:PORT, or a gRPC target with a scheme (dns:///HOST:PORT, ...).

    A bare host is refused: gRPC would dial its default port 443, which no kvhandoff listens
    on, and the user would see only UNAVAILABLE."""
    text = text.strip()
    if text.startswith(SCHEMES):
        return text
    match = HOST_PORT.fullmatch(text)
    if match is None or not 0 < int(match.group(2)) <= 65535:
        example = f"{text}:50051" if text and ":" not in text else "127.0.0.1:50051"
        raise argparse.ArgumentTypeError(
            f"{text!r} is not HOST:PORT; give the port too, e.g. {example} for decode (without "
            f"one gRPC dials port 443)")
    return text
