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
from kvhandoff_cli.settings_help import ROLE_HELP, SERVICE_HELP

ENV_PREFIX = "KVHANDOFF_"
CONFIG_ENV = "KVHANDOFF_CONFIG"
ROLES = ("prefill", "decode")

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
    "borrow_min_tokens": (1, None), "local_prefill_max_tokens": (0, None),
    "local_prefill_burst_tokens": (0, None), "local_prefill_queue_depth": (0, None),
    "local_prefill_chunk_tokens": (1, None),
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
