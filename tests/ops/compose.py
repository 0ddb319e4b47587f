"""Reading compose files the way Docker Compose does, enough to run their services locally.

Covers what compose.yaml and compose.cpu.yaml use: YAML anchors and `<<` merge keys,
`${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`, `${VAR?error}` and `$$`
interpolation in every string value, the `!reset` and `!override` tags, and the merge rules
for several -f files (mappings merge, sequences append, command/entrypoint/healthcheck.test
are replaced, ports and volumes are de-duplicated).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml


class Reset:
    """`!reset`: remove the key from the merged model."""


@dataclass(frozen=True)
class Override:
    """`!override VALUE`: replace instead of merging."""

    value: object


class _ComposeLoader(yaml.SafeLoader):
    pass


def _reset(loader, node):
    return Reset()


def _override(loader, node):
    if isinstance(node, yaml.MappingNode):
        return Override(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Override(loader.construct_sequence(node, deep=True))
    return Override(loader.construct_scalar(node))


_ComposeLoader.add_constructor("!reset", _reset)
_ComposeLoader.add_constructor("!override", _override)

_VAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\?|\?)(?P<arg>.*))?$",
                     re.S)
REPLACED = {("command",), ("entrypoint",), ("healthcheck", "test")}
UNIQUE_LISTS = {"ports", "volumes", "expose"}


class InterpolationError(ValueError):
    pass


def interpolate(text: str, env: Mapping[str, str]) -> str:
    def substitute(match: re.Match) -> str:
        if match.group("escaped"):
            return "$"
        if match.group("named"):
            return env.get(match.group("named"), "")
        spec = _BRACED.match(match.group("braced"))
        if spec is None:
            raise InterpolationError(f"invalid interpolation ${{{match.group('braced')}}}")
        name, op, arg = spec.group("name"), spec.group("op"), spec.group("arg")
        value = env.get(name)
        unset = value is None or (value == "" and op in (":-", ":?"))
        if op in (":-", "-"):
            return interpolate(arg, env) if unset else value
        if op in (":?", "?"):
            if unset:
                raise InterpolationError(f"{name}: {arg or 'required'}")
            return value
        return value or ""

    return _VAR.sub(substitute, text)


def _interpolate_tree(node, env: Mapping[str, str]):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {key: _interpolate_tree(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [_interpolate_tree(value, env) for value in node]
    if isinstance(node, Override):
        return Override(_interpolate_tree(node.value, env))
    return node


def _strip_tags(node):
    if isinstance(node, Override):
        return _strip_tags(node.value)
    if isinstance(node, dict):
        return {k: _strip_tags(v) for k, v in node.items() if not isinstance(v, Reset)}
    if isinstance(node, list):
        return [_strip_tags(v) for v in node]
    return node


def _merge(base, over, path: tuple[str, ...]):
    if isinstance(over, Reset):
        return Reset()
    if isinstance(over, Override):
        return over.value
    if isinstance(base, dict) and isinstance(over, dict):
        merged = dict(base)
        for key, value in over.items():
            merged[key] = _merge(base[key], value, (*path, key)) if key in base else value
        return {k: v for k, v in merged.items() if not isinstance(v, Reset)}
    if isinstance(base, list) and isinstance(over, list) and path[-2:] not in REPLACED \
            and path[-1:] not in REPLACED:
        merged = base + over
        if path and path[-1] in UNIQUE_LISTS:
            merged = list(dict.fromkeys(merged))
        return merged
    return over


def load(files: list[Path], env: Mapping[str, str]) -> dict:
    """The merged, interpolated compose model of `files` (later files override earlier)."""
    model: dict = {}
    for path in files:
        raw = yaml.load(Path(path).read_text(), Loader=_ComposeLoader)
        model = _merge(model, _interpolate_tree(raw, env), ())
    return _strip_tags(model)


def environment(service: dict) -> dict[str, str]:
    """A service's environment as a dict of strings (mapping or KEY=VALUE list form)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def start_order(services: dict) -> list[str]:
    """Services in dependency order (depends_on first)."""
    order: list[str] = []

    def visit(name: str, seen: tuple[str, ...]) -> None:
        if name in order:
            return
        if name in seen:
            raise ValueError(f"depends_on cycle through {name}")
        for dep in services[name].get("depends_on") or {}:
            visit(dep, (*seen, name))
        order.append(name)

    for name in services:
        visit(name, ())
    return order
