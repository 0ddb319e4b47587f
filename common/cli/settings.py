"""Service flags and their sources: config file (TOML) < environment (KVHANDOFF_*) < flags.

Every flag of a service command maps to one field of ServiceConfig / PrefillConfig /
DecodeConfig; the environment name is KVHANDOFF_ plus the flag in upper case with '_'.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from pathlib import Path

from common.config import DecodeConfig, PrefillConfig, ServiceConfig

ENV_PREFIX = "KVHANDOFF_"

SERVICE_HELP = {
    "model": "'demo' or a Hugging Face checkpoint directory (Llama, Qwen2)",
    "host": "address to bind", "port": "gRPC port (0 picks a free one)",
    "device": "auto, cpu, cuda or cuda:N", "dtype": "auto, float32, float16, bfloat16",
    "kernels": "auto (triton on CUDA, torch on CPU), triton or torch",
    "page_size": "tokens per KV page",
    "pool_tokens": "KV pool size in tokens (0: size from --memory-fraction/--kv-cache-bytes)",
    "memory_fraction": "share of free device memory (or of --kv-cache-bytes on the CPU) for KV",
    "kv_cache_bytes": "KV byte budget on the CPU",
    "max_context_tokens": "context window (0: the model's max_position_embeddings)",
    "allow_context_beyond_pool": "start even if the pool is smaller than the window; the pool "
                                 "then bounds prompts",
    "poison_freed_pages": "fill freed pages with NaN (tests)",
    "scrub_freed_pages": "zero freed pages",
    "check_page_owners": "check every batch's page table against page owners before each step",
    "metrics_port": "Prometheus /metrics port (-1: off, 0: any free port)",
    "tls_cert": "PEM certificate for the prefill<->decode channel (mTLS)",
    "tls_key": "PEM key for --tls-cert", "tls_ca": "PEM CA that signs the peers' certificates",
    "grace_seconds": "drain time on SIGTERM",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_fields(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        help_text = SERVICE_HELP.get(f.name, f.name.replace("_", " "))
        if f.type in ("bool", bool):
            parser.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=f.default, help=help_text)
        else:
            kind = {"int": int, "float": float, "str": str}[str(f.type)]
            parser.add_argument(_flag(f.name), dest=f.name, type=kind, default=f.default,
                                help=f"{help_text} (default: %(default)s)")


def add_service_flags(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument("--config", type=Path, help="TOML file with [service] and [prefill] or "
                        "[decode] tables; environment and flags override it")
    _add_fields(parser, ServiceConfig)
    role_cls = PrefillConfig if role == "prefill" else DecodeConfig
    _add_fields(parser, role_cls, skip=("service",))
    if role == "decode":
        parser.add_argument("--prefill", dest="prefill_target", default=DecodeConfig.prefill_target,
                            help="prefill address HOST:PORT (a DNS name balances over replicas)")
    parser.add_argument("--port-file", type=Path, help="write the bound gRPC port here")


def _coerce(value: str, default):
    if isinstance(default, bool):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return type(default)(value)


def apply_sources(parser: argparse.ArgumentParser, argv: list[str], role: str) -> argparse.Namespace:
    """Parses argv with defaults taken from the TOML file, then the environment."""
    first = parser.parse_args(argv)
    defaults: dict = {}
    if getattr(first, "config", None):
        raw = tomllib.loads(Path(first.config).read_text())
        unknown = set(raw) - {"service", role}
        if unknown:
            parser.error(f"{first.config}: unknown tables {sorted(unknown)}")
        for table in ("service", role):
            defaults.update(raw.get(table, {}))
    for action in parser._actions:
        env = ENV_PREFIX + action.dest.upper()
        if env in os.environ and action.dest not in ("help", "config"):
            defaults[action.dest] = _coerce(os.environ[env], action.default)
    known = {a.dest for a in parser._actions}
    bad = set(defaults) - known
    if bad:
        parser.error(f"unknown settings {sorted(bad)}")
    parser.set_defaults(**defaults)
    return parser.parse_args(argv)


def build_config(ns: argparse.Namespace, role: str) -> PrefillConfig | DecodeConfig:
    """Builds and validates the role's frozen config from parsed arguments."""
    service = ServiceConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServiceConfig)})
    for name in ("page_size",):
        if getattr(service, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= service.memory_fraction <= 1:
        raise ValueError("--memory-fraction must be in [0, 1]")
    cls = PrefillConfig if role == "prefill" else DecodeConfig
    rest = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if f.name != "service"}
    return cls(service=service, **rest)
