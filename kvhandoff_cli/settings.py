"""Service settings and their sources: defaults < TOML file < environment < flags.

Every setting is one field of ServiceConfig plus PrefillConfig or DecodeConfig. Its flag is
`--` + the field name with '-' (except `--prefill` for decode's `prefill_target`); its
environment variable is KVHANDOFF_ + the field name in upper case (KVHANDOFF_PREFILL_TARGET);
its TOML key is the field name, under `[service]` (shared fields) or `[prefill]`/`[decode]`.
The file comes from `--config FILE`, else from KVHANDOFF_CONFIG. An empty environment
variable counts as unset (compose writes `${X:-}` as "").

Invariants: every value is type-checked where it enters (file, environment, flag) and
range-checked once all sources are merged; any error names its source and ends the command
with exit status 2 before anything is loaded. Unknown keys in the file are errors; unknown
KVHANDOFF_* variables are ignored (one environment may serve both roles).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path

from common.config import DecodeConfig, PrefillConfig, ServiceConfig
from common.server.cpu_placement import CpuListError, check_cpu_affinity
from common.server.prefill_target import parse_target

ENV_PREFIX = "KVHANDOFF_"
CONFIG_ENV = "KVHANDOFF_CONFIG"
ROLES = ("prefill", "decode")

SERVICE_HELP = {
    "model": "'demo' or a Hugging Face checkpoint directory (Llama, Mistral, Qwen2, Qwen3)",
    "host": "address to bind",
    "port": "gRPC port (0 picks a free one; prefill 50061, decode 50051 by default)",
    "device": "auto, cpu, cuda or cuda:N", "dtype": "auto, float32, float16, bfloat16",
    "kernels": "auto (triton on CUDA, cpu on CPU), triton, cpu or torch (reference)",
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
    "grace_seconds": "drain time on SIGTERM: in-flight requests get this long to finish",
    "allow_protocol_1_0": "accept prefills that speak protocol 1.0 (no nonce, prompt digest or "
                          "frame checksums); logged at start and counted per handoff",
    "content_checks": "check the KV content of every handoff before streaming (layer 0, depth, "
                      "finiteness); --no-content-checks is for benchmarks of their cost only",
    "verify_depth_positions": "random prompt positions decode recomputes through every layer, "
                              "besides the last one",
    "verify_full_fraction": "share of handoffs (0 to 1, drawn unguessably per handoff) for which "
                            "decode recomputes the whole prompt and compares every layer at every "
                            "position (SPEC.md D-49); costs one prefill of the prompt on decode",
    "torch_threads": "torch intra-op threads (0: one per CPU of --cpu-affinity, else torch's "
                     "default)",
    "cpu_affinity": "CPUs the service runs on, e.g. 0-3,6 (empty: the ones it was started with)",
    "borrow_cpus": "the peer service's CPUs this one also computes on while the peer idles, "
                   "e.g. 0 (needs --cpu-affinity and --busy-file; kvhandoff up sets both)",
    "busy_file": "lock file shared by a prefill and a decode on one host: decode holds it while "
                 "it computes, prefill borrows decode's CPUs only when it is free",
}
ROLE_HELP = {
    "shm_dir": "directory of the shared-memory regions (a tmpfs both services see)",
    "allow_planes_without_tls": "with TLS configured, still allow data planes whose bytes "
                                "bypass the channel's TLS (shared memory, NIXL)",
    "shared_memory": "offer the shared-memory data plane to decodes on this host",
    "release_grace_s": "seconds out-of-band KV bytes outlive their stream when decode never "
                       "releases them",
    "nixl": "offer the NIXL data plane (decode READs the KV from prefill's NIXL agent)",
    "nixl_read_timeout_s": "seconds one NIXL READ of a chunk may take before it is refused",
    "nixl_from_pages": "serve NIXL handoffs of a host-memory pool straight from the KV pages "
                       "(held until decode releases them) instead of a packed buffer; off by "
                       "default: the whole handoff is registered on its first chunk, so slots "
                       "not yet written are readable by the peer",
    "nixl_lease_max_pages": "the most KV pages NIXL handoffs served from the pages may hold at "
                            "once (0: half the pool); past it a handoff is packed",
    "nixl_lease_max_handoffs": "the most NIXL handoffs served from the pages at once; past it "
                               "a handoff is packed",
    "data_plane": "how KV travels from prefill: inline, shared-memory, nixl, or auto (the "
                  "fastest both sides offer, else inline)",
    "max_batch_tokens": "prompt tokens in one prefill forward pass (all prompts in it); the "
                        "activation peak measured at start-up is a pass of this many",
    "prefill_chunk_tokens": "chunked prefill: the most tokens of one prompt a forward pass "
                            "computes; longer prompts take several passes",
    "prefix_cache": "keep whole pages of prompt KV for later requests of the same cache scope "
                    "(the caller's identity and cache_salt; a request with neither shares "
                    "with nobody)",
    "prefix_cache_max_pages": "the most pool pages the prefix cache may hold (0: as many as "
                              "the pool has; unread cached pages count as free)",
    "max_unsent_bytes": "KV bytes packed but not yet sent, over all streams; a slow decode "
                        "pauses its prefill beyond this",
    "prefill_target": "prefill replicas HOST:PORT[,HOST:PORT...]; a DNS name stands for "
                      "every address it resolves to (re-resolved), one replica each",
    "prefill_choice": "how decode picks a prefill replica per request: prefix (the same "
                      "scope and first page go to the same replica, unless it is busy) or "
                      "round-robin",
    "prefill_busy_slack": "handoffs in flight beyond the least loaded replica's at which a "
                          "request's favourite replica counts as busy",
    "http_slow_reader_s": "seconds an HTTP stream may wait for its client to read before "
                          "it is cancelled and its pages freed",
    "http_stream_buffer_bytes": "bytes of an HTTP stream decode may hold for a client that "
                                "reads slowly (socket send buffer and write buffer) before "
                                "generation waits for it",
    "handoff_retries": "times a handoff that failed before any token was sent is asked "
                       "again on another prefill replica",
    "max_batch": "sequences in the running decode batch",
    "max_waiting": "requests waiting for pages or a batch slot before ADMISSION_QUEUE_FULL",
    "default_max_tokens": "max_tokens of a request that sets none",
    "handoff_timeout_s": "seconds a handoff from prefill may take",
    "max_chunk_bytes": "largest KV chunk decode accepts from prefill",
    "prefill_info_interval_s": "seconds between decode's checks of prefill's model, layout "
                               "and limits",
    "api_token": "bearer token clients must send (empty: none; redacted by config show)",
    "api_tokens": "file of 'TENANT TOKEN' lines: the tokens clients may send and the "
                  "tenant each names (reloaded on SIGHUP; not with --api-token)",
    "api_tls_cert": "PEM certificate for the client API (TLS)",
    "api_tls_key": "PEM key for --api-tls-cert",
    "http_port": "OpenAI-compatible HTTP API port: /v1/models, /v1/completions, "
                 "/v1/chat/completions, /health, /metrics (-1: off, 0: any free port)",
    "local_prefill": "compute prompts' KV in this process instead of asking prefill "
                     "(a baseline for benchmarks)",
}
# Defaults that differ by role (the dataclass default is the one both roles share): the
# ports of docs/operations.md, so `kvhandoff prefill` and `kvhandoff decode` started with no
# flags find each other (decode's --prefill defaults to 127.0.0.1:50061).
ROLE_DEFAULTS = {"prefill": {"port": 50061}, "decode": {"port": 50051}}
# Values that config show prints as REDACTED_TEXT when set.
SECRET_FIELDS = ("api_token",)
REDACTED_TEXT = "<redacted>"

# Range checks after merging: field -> (lowest, highest); None is unbounded.
RANGES: dict[str, tuple[float | None, float | None]] = {
    "port": (0, 65535), "metrics_port": (-1, 65535), "page_size": (1, None),
    "pool_tokens": (0, None), "memory_fraction": (0, 1), "kv_cache_bytes": (0, None),
    "max_context_tokens": (0, None), "grace_seconds": (0, None), "max_batch_tokens": (1, None),
    "prefill_chunk_tokens": (1, None),
    "max_unsent_bytes": (1, None),
    "max_batch": (1, None), "max_waiting": (0, None), "default_max_tokens": (1, None),
    "handoff_timeout_s": (0.001, None), "max_chunk_bytes": (1, None),
    "prefill_info_interval_s": (0.01, None), "verify_depth_positions": (0, 1024),
    "verify_full_fraction": (0, 1), "http_port": (-1, 65535),
    "release_grace_s": (0, None), "prefix_cache_max_pages": (0, None),
    "nixl_read_timeout_s": (0.001, None), "torch_threads": (0, 1024),
    "nixl_lease_max_pages": (0, None), "nixl_lease_max_handoffs": (1, None),
    "prefill_busy_slack": (1, None), "handoff_retries": (0, 5),
    "http_slow_reader_s": (0.001, None), "http_stream_buffer_bytes": (4096, 1 << 30),
}
CHOICES = {"dtype": ("auto", "float32", "float16", "bfloat16"),
           "kernels": ("auto", "triton", "torch", "cpu"),
           "data_plane": ("inline", "shared-memory", "nixl", "auto"),
           "prefill_choice": ("prefix", "round-robin")}
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
# (a, b): a is set only together with b.
REQUIRES = [("tls_key", "tls_cert"), ("tls_cert", "tls_key"), ("tls_ca", "tls_cert"),
            ("api_tls_key", "api_tls_cert"), ("api_tls_cert", "api_tls_key"),
            ("borrow_cpus", "busy_file"), ("borrow_cpus", "cpu_affinity")]
FILE_FIELDS = ("tls_cert", "tls_key", "tls_ca", "api_tls_cert", "api_tls_key")
TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class SettingsError(ValueError):
    """A setting that cannot be used; the message names the source and what to change."""


def _role_class(role: str) -> type:
    return PrefillConfig if role == "prefill" else DecodeConfig


def table_fields(table: str) -> dict[str, dataclasses.Field]:
    """The fields a TOML table may set: [service] shared ones, [prefill]/[decode] the role's."""
    cls = ServiceConfig if table == "service" else _role_class(table)
    return {f.name: f for f in dataclasses.fields(cls) if f.name != "service"}


def role_fields(role: str) -> dict[str, dataclasses.Field]:
    return {**table_fields("service"), **table_fields(role)}


def default_of(f: dataclasses.Field, role: str):
    """The field's default for this role (ROLE_DEFAULTS first, then the dataclass)."""
    return ROLE_DEFAULTS.get(role, {}).get(f.name, f.default)


def redacted(settings: dict) -> dict:
    """A copy of a config's asdict() with secret values replaced (empty ones stay empty)."""
    out = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            value = redacted(value)
        elif key in SECRET_FIELDS and value:
            value = REDACTED_TEXT
        out[key] = value
    return out


def _flag(name: str) -> str:
    return "--prefill" if name == "prefill_target" else "--" + name.replace("_", "-")


def add_service_flags(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument("--config", type=Path, help=f"TOML file with [service] and [{role}] "
                        f"tables (default: ${CONFIG_ENV}); environment and flags override it")
    for f in role_fields(role).values():
        help_text = SERVICE_HELP.get(f.name) or ROLE_HELP[f.name]
        if str(f.type) == "bool":
            parser.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=f.default, help=f"{help_text} (default: %(default)s)")
        else:
            # a float flag is converted in resolve, as the environment's values are: a bad one
            # is then one line naming the flag, not argparse's usage text
            kind = {"int": int, "float": str, "str": str}[str(f.type)]
            parser.add_argument(_flag(f.name), dest=f.name, type=kind,
                                default=default_of(f, role),
                                help=f"{help_text} (default: %(default)s)")
    parser.add_argument("--port-file", type=Path,
                        help="write the bound gRPC port here once serving (default: nowhere)")


def _typed(value, kind: str, where: str):
    """A TOML value checked against the field's type (ints are accepted as floats)."""
    ok = {"bool": isinstance(value, bool), "str": isinstance(value, str),
          "int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool)}[kind]
    if not ok:
        raise SettingsError(f"{where}: expected {TYPE_WORDS[kind]}, got "
                            f"{type(value).__name__} {value!r}")
    return float(value) if kind == "float" else value


def _parsed(text: str, kind: str, where: str):
    """An environment string converted to the field's type."""
    if kind == "bool":
        word = text.strip().lower()
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return word in TRUE_WORDS
    else:
        try:
            return {"int": int, "float": float, "str": str}[kind](text.strip())
        except ValueError:
            pass
    choices = f" ({'/'.join(TRUE_WORDS + FALSE_WORDS)})" if kind == "bool" else ""
    raise SettingsError(f"{where}={text!r}: expected {TYPE_WORDS[kind]}{choices}")


def read_file(path: Path, role: str) -> dict[str, tuple[object, str]]:
    """field -> (value, source) from the TOML file; tables for both roles are checked."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as err:
        raise SettingsError(f"config file {path}: {err.strerror or err}") from err
    except tomllib.TOMLDecodeError as err:
        raise SettingsError(f"config file {path}: invalid TOML: {err}") from err
    values: dict[str, tuple[object, str]] = {}
    problems: list[str] = []  # every one of them, so one edit of the file can fix all
    for table, entries in raw.items():
        if table not in ("service", *ROLES) or not isinstance(entries, dict):
            problems.append(f"{path}: unknown {'table' if isinstance(entries, dict) else 'key'}"
                            f" {table!r}; settings go under [service], [prefill] or [decode]")
            continue
        known = table_fields(table)
        for key, value in entries.items():
            where = f"{path} [{table}] {key}"
            if key not in known:
                problems.append(f"{path} [{table}]: unknown key {key!r}; known keys: "
                                f"{', '.join(sorted(known))}")
                continue
            try:
                typed = _typed(value, str(known[key].type), where)
            except SettingsError as err:
                problems.append(str(err))
                continue
            if table in ("service", role):
                values[key] = (typed, where)
    if problems:
        raise SettingsError("; ".join(problems))
    return values


def read_env(env: Mapping[str, str], role: str) -> dict[str, tuple[object, str]]:
    values: dict[str, tuple[object, str]] = {}
    problems: list[str] = []
    for name, f in role_fields(role).items():
        var = ENV_PREFIX + name.upper()
        if env.get(var, "") != "":
            try:
                values[name] = (_parsed(env[var], str(f.type), var), f"${var}")
            except SettingsError as err:
                problems.append(str(err))
    if problems:
        raise SettingsError("; ".join(problems))
    return values


def resolve(parser: argparse.ArgumentParser, argv: list[str], role: str,
            env: Mapping[str, str]) -> tuple[argparse.Namespace, dict[str, str]]:
    """Merges the sources; returns the namespace and, per field, where its value came from."""
    unset = object()
    dests = [a.dest for a in parser._actions if a.dest != "help"]
    given = vars(parser.parse_args(argv, argparse.Namespace(**{d: unset for d in dests})))
    config_path = given["config"] if given["config"] is not unset else env.get(CONFIG_ENV) or None
    layers = [read_file(Path(config_path), role) if config_path else {}, read_env(env, role)]
    fields = role_fields(role)
    merged: dict[str, object] = {}
    sources: dict[str, str] = {}
    for name, f in fields.items():
        merged[name], sources[name] = default_of(f, role), "default"
        for layer in layers:
            if name in layer:
                merged[name], sources[name] = layer[name]
        if given[name] is not unset:
            value = given[name]
            if str(f.type) == "float" and isinstance(value, str):
                value = _parsed(value, "float", _flag(name))
            merged[name], sources[name] = value, _flag(name)
    check_values(merged, sources)
    port_file = given["port_file"] if given["port_file"] is not unset else None
    ns = argparse.Namespace(config=Path(config_path) if config_path else None,
                            port_file=port_file, **merged)
    return ns, sources


def apply_sources(parser: argparse.ArgumentParser, argv: list[str],
                  role: str) -> argparse.Namespace:
    """Parses argv over the file and the environment; on any bad setting prints one clear
    error line and exits with status 2, as argparse does for a bad flag."""
    try:
        return resolve(parser, argv, role, os.environ)[0]
    except SettingsError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")


def _tokens_file_problems(path: str, where: str) -> list[str]:
    """The tokens file's refusal, if any (it names the line, never a token)."""
    from common.server.tenants import TenantsFileError, read_token_entries

    try:
        read_token_entries(path)
    except TenantsFileError as err:
        return [f"{where}: {err}"]
    return []


def check_values(values: Mapping[str, object], sources: Mapping[str, str] | None = None) -> None:
    """Range, choice and consistency checks on merged settings; raises SettingsError listing
    every problem, each with the source of the value."""
    src = sources or {}

    def label(name: str) -> str:
        return src.get(name) if src.get(name, "default") != "default" else _flag(name)

    problems: list[str] = []
    for name, value in values.items():
        low, high = RANGES.get(name, (None, None))
        if isinstance(value, float) and math.isnan(value):  # NaN passes every comparison
            problems.append(f"{label(name)}: {name} must be a number, got nan")
        elif low is not None and value < low or high is not None and value > high:
            bounds = (f"in [{low}, {high}]" if high is not None else f">= {low}")
            problems.append(f"{label(name)}: {name} must be {bounds}, got {value!r}")
        if name in CHOICES and value not in CHOICES[name]:
            problems.append(f"{label(name)}: {name} must be one of {', '.join(CHOICES[name])}, "
                            f"got {value!r}")
        if name in FILE_FIELDS and value and not Path(str(value)).is_file():
            problems.append(f"{label(name)}: {name} file {value!r} does not exist")
    for name in ("cpu_affinity", "borrow_cpus"):
        if values.get(name):
            try:
                check_cpu_affinity(str(values[name]))
            except CpuListError as err:
                problems.append(f"{label(name)}: {err}")
    if values.get("prefill_target"):
        try:
            parse_target(str(values["prefill_target"]))
        except ValueError as err:
            problems.append(f"{label('prefill_target')}: {err}")
    if "device" in values and not DEVICE_PATTERN.fullmatch(str(values["device"])):
        problems.append(f"{label('device')}: device must be auto, cpu, cuda or cuda:N, "
                        f"got {values['device']!r}")
    for name, needs in REQUIRES:
        if values.get(name) and not values.get(needs):
            problems.append(f"{label(name)}: {name} is set but {needs} is not; set both")
    if values.get("verify_full_fraction") and values.get("content_checks") is False:
        problems.append(f"{label('verify_full_fraction')}: the audit is one of the content "
                        "checks; it cannot run with --no-content-checks (drop one of them)")
    if values.get("api_token") and values.get("api_tokens"):
        problems.append(f"{label('api_tokens')}: api_tokens and api_token are both set; "
                        "use one (the single token is the line 'default TOKEN' in the "
                        "file)")
    elif values.get("api_tokens"):
        problems.extend(_tokens_file_problems(str(values["api_tokens"]), label("api_tokens")))
    if str(values.get("model", "x")).strip() == "":
        problems.append(f"{label('model')}: model must be 'demo' or a checkpoint directory")
    if problems:
        raise SettingsError("; ".join(problems))


def build_config(ns: argparse.Namespace, role: str) -> PrefillConfig | DecodeConfig:
    """Builds the role's frozen config from parsed arguments; raises SettingsError (a
    ValueError) when a value is out of range."""
    fields = role_fields(role)
    check_values({name: getattr(ns, name) for name in fields})
    service = ServiceConfig(**{name: getattr(ns, name) for name in table_fields("service")})
    rest = {name: getattr(ns, name) for name in table_fields(role)}
    return _role_class(role)(service=service, **rest)
