"""compose.yaml, run without Docker: each service's command and environment, resolved the way
compose resolves them, started as local processes on loopback, gated by the compose
healthcheck command itself, then a generation through the pair. Plus the file's static
promises (one GPU each, read-only models, drain shorter than the stop grace period, the CPU
variant) and `docker compose config` where a compose binary exists."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.cluster import REPO, generate
from tests.ops import compose

COMPOSE = REPO / "compose.yaml"
COMPOSE_CPU = REPO / "compose.cpu.yaml"
START_TIMEOUT = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seconds(duration: str) -> float:
    """A compose duration ('50s', '1m30s', '10m') in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", str(duration))
    assert parts and "".join(n + u for n, u in parts) == str(duration), duration
    return sum(float(n) * units[u] for n, u in parts)


def local_argv(argv: list[str]) -> list[str]:
    """A container command as a local one: the image's `kvhandoff` and `python` are ours."""
    head, *rest = argv
    if head == "kvhandoff":
        return [sys.executable, "-m", "kvhandoff_cli.main", *rest]
    if head == "python":
        return [sys.executable, *rest]
    raise AssertionError(f"compose command uses {head!r}, which the image may not have")


def healthcheck_argv(service: dict) -> list[str]:
    test = service["healthcheck"]["test"]
    assert isinstance(test, list) and test[0] == "CMD", "healthcheck must be exec form (CMD)"
    return local_argv(test[1:])


def local_env(service: dict, service_names: list[str]) -> dict[str, str]:
    """The process environment: ours without KVHANDOFF_*, then the service's, with addresses
    mapped to loopback (bind 127.0.0.1, reach other services at 127.0.0.1)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVHANDOFF_")}
    env.update(compose.environment(service))
    env["KVHANDOFF_HOST"] = "127.0.0.1"
    for key, value in env.items():
        if key.startswith("KVHANDOFF_"):
            for name in service_names:
                value = re.sub(rf"^{name}:(\d+)$", r"127.0.0.1:\1", value)
            env[key] = value
    env["PYTHONUNBUFFERED"] = "1"
    return env


def wait_healthy(name: str, service: dict, proc: subprocess.Popen, log: Path) -> None:
    argv = healthcheck_argv(service)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited with {proc.returncode}:\n"
                                 f"{log.read_text()[-3000:]}")
        probe = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            assert "SERVING" in probe.stdout
            return
        time.sleep(0.5)
    raise AssertionError(f"{name} not healthy after {START_TIMEOUT}s:\n{log.read_text()[-3000:]}")


def _events(log: Path) -> list[dict]:
    """The JSON log lines of a service (other output skipped)."""
    events = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return events


@pytest.fixture(scope="module")
def interpolation_env(tmp_path_factory) -> dict[str, str]:
    """What a user would export: the demo model and (here) free ports, and a private directory
    standing in for the shared tmpfs volume (both local processes see the same one, as both
    containers mount the same volume)."""
    shm = tmp_path_factory.mktemp("kvh-shm")
    shm.chmod(0o700)
    return {"KVHANDOFF_MODEL": "demo", "PREFILL_PORT": str(free_port()),
            "DECODE_PORT": str(free_port()), "PREFILL_METRICS_PORT": str(free_port()),
            "DECODE_METRICS_PORT": str(free_port()), "KVHANDOFF_SHM_DIR": str(shm)}


@pytest.mark.slow
def test_compose_services_run_locally_and_generate(tmp_path, interpolation_env):
    model = compose.load([COMPOSE], interpolation_env)
    services = model["services"]
    order = compose.start_order(services)
    assert order == ["prefill", "decode"]
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name in order:
            service = services[name]
            log = tmp_path / f"{name}.log"
            procs[name] = subprocess.Popen(
                local_argv(service["command"]), cwd=REPO, env=local_env(service, order),
                stdout=log.open("w"), stderr=subprocess.STDOUT)
            wait_healthy(name, service, procs[name], log)
        decode_env = compose.environment(services["decode"])
        address = f"127.0.0.1:{decode_env['KVHANDOFF_PORT']}"
        assert decode_env["KVHANDOFF_PORT"] == interpolation_env["DECODE_PORT"]
        result = generate(address, text="Once upon a time", max_tokens=8, ignore_eos=True)
        assert result.completion_tokens == 8 and len(result.token_ids) == 8
        for name in order:
            port = compose.environment(services[name])["KVHANDOFF_METRICS_PORT"]
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
            assert f'kvhandoff_pool_pages{{model_name="demo",role="{name}"}}'.encode() in body
        # compose's settings put the handoff on the shared-memory plane: decode chose it at
        # the handshake and served the request over it, and no region is left behind
        events = _events(tmp_path / "decode.log")
        assert [e["plane"] for e in events if e["event"] == "data_plane_chosen"] == [
            "shared-memory"], events[-5:]
        assert [e["plane"] for e in events if e["event"] == "handoff_verified"] == [
            "shared-memory"]
        assert not list(Path(interpolation_env["KVHANDOFF_SHM_DIR"]).glob("kvh-*"))
        grace = seconds(services["decode"]["stop_grace_period"])
        for name in reversed(order):
            procs[name].send_signal(signal.SIGTERM)
            assert procs[name].wait(timeout=grace) == 0, (tmp_path / f"{name}.log").read_text()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_compose_reserves_one_gpu_per_service_and_mounts_models_read_only():
    services = compose.load([COMPOSE], {"MODEL_DIR": "/data/llama"})["services"]
    ids = []
    for name in ("prefill", "decode"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        ids += device["device_ids"]
        assert "/data/llama:/models:ro" in services[name]["volumes"]
        assert compose.environment(services[name])["KVHANDOFF_MODEL"] == "/models"
    assert ids == ["0", "1"]
    assert services["decode"]["depends_on"] == {"prefill": {"condition": "service_healthy"}}


def test_compose_shares_one_shm_volume_at_one_path_with_one_uid():
    """The shared-memory plane's needs: the same tmpfs volume at the same --shm-dir in both
    containers, the same uid (regions are 0600, owner-checked), decode on --data-plane auto."""
    model = compose.load([COMPOSE], {})
    services = model["services"]
    for name in ("prefill", "decode"):
        service = services[name]
        env = compose.environment(service)
        assert env["KVHANDOFF_SHM_DIR"] == "/kvh-shm"
        assert "kvh-shm:/kvh-shm" in service["volumes"]
        assert service["user"] == "10001:10001"
    assert compose.environment(services["decode"])["KVHANDOFF_DATA_PLANE"] == "auto"
    assert "KVHANDOFF_DATA_PLANE" not in compose.environment(services["prefill"])
    volume = model["volumes"]["kvh-shm"]
    assert volume["driver_opts"]["type"] == "tmpfs"
    opts = dict(o.split("=", 1) for o in volume["driver_opts"]["o"].split(","))
    assert opts["uid"] == "10001" and opts["mode"] == "0700"
    moved = compose.load([COMPOSE], {"KVHANDOFF_SHM_DIR": "/run/kvh"})["services"]
    for name in ("prefill", "decode"):  # one knob moves the mount and the flag together
        assert compose.environment(moved[name])["KVHANDOFF_SHM_DIR"] == "/run/kvh"
        assert "kvh-shm:/run/kvh" in moved[name]["volumes"]


def test_compose_knobs_come_from_the_environment():
    env = {"PREFILL_GPU": "2", "DECODE_GPU": "3", "DECODE_PORT": "6000",
           "DECODE_POOL_TOKENS": "4096", "KVHANDOFF_MODEL": "demo", "PREFILL_PORT": "6001"}
    services = compose.load([COMPOSE], env)["services"]
    decode = compose.environment(services["decode"])
    assert decode["KVHANDOFF_PORT"] == "6000" and decode["KVHANDOFF_POOL_TOKENS"] == "4096"
    assert decode["KVHANDOFF_PREFILL_TARGET"] == "prefill:6001"
    assert decode["KVHANDOFF_MODEL"] == "demo"
    assert services["prefill"]["deploy"]["resources"]["reservations"]["devices"][0][
        "device_ids"] == ["2"]
    assert "127.0.0.1:6000" in " ".join(services["decode"]["healthcheck"]["test"])


def test_stop_grace_period_outlasts_the_drain():
    services = compose.load([COMPOSE], {})["services"]
    for name, service in services.items():
        drain = float(compose.environment(service)["KVHANDOFF_GRACE_SECONDS"])
        assert seconds(service["stop_grace_period"]) > drain + 10, name
        assert service["stop_signal"] == "SIGTERM"
        assert "kvhandoff_cli.health_probe" in service["healthcheck"]["test"]


def test_cpu_variant_drops_gpus_and_uses_cpu_torch():
    services = compose.load([COMPOSE, COMPOSE_CPU], {})["services"]
    for name, service in services.items():
        assert "devices" not in service["deploy"]["resources"]["reservations"], name
        assert compose.environment(service)["KVHANDOFF_DEVICE"] == "cpu"
        assert service["build"]["args"]["TORCH_INDEX_URL"].endswith("/whl/cpu")
        assert service["command"] == ["kvhandoff", name]
        assert "healthcheck" in service and service["image"] == "kvhandoff:cpu"
    assert services["decode"]["depends_on"]["prefill"]["condition"] == "service_healthy"


def _compose_binary() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(
            ["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return None


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, COMPOSE_CPU]], ids=["gpu", "cpu"])
def test_docker_compose_config_accepts_the_files(files):
    binary = _compose_binary()
    if binary is None:
        pytest.skip("no docker compose / docker-compose binary on this machine")
    argv = [*binary, *[a for f in files for a in ("-f", str(f))], "config", "--quiet"]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "KVHANDOFF_MODEL": "demo"})
    assert result.returncode == 0, result.stderr
