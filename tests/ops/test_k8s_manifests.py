"""deploy/k8s: the manifests say what docs/operations.md says, and their settings are ones the
services accept (the ConfigMap's TOML goes through the real settings checks)."""

from __future__ import annotations

import json
import os
import re
import tomllib

import pytest
import yaml

from kvhandoff_cli.main import main
from kvhandoff_cli.settings import ENV_PREFIX, role_fields
from tests.helpers.cluster import REPO

K8S = REPO / "deploy" / "k8s"
PORTS = {"prefill": 50061, "decode": 50051}


def _docs() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = []
    for resource in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / resource).read_text()) if d]
    return docs


def _find(kind: str, name: str) -> dict:
    (doc,) = [d for d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _config_toml() -> str:
    return _find("ConfigMap", "kvhandoff-config")["data"]["config.toml"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_deployment_probes_resources_and_shutdown(role):
    spec = _find("Deployment", f"kvhandoff-{role}")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["command"] == ["kvhandoff", role]
    port = PORTS[role]
    assert {"name": "grpc", "containerPort": port} in container["ports"]
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["grpc"] == {"port": port}, probe
    assert "grpc" not in container["livenessProbe"]  # NOT_SERVING while draining is no crash
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["KVHANDOFF_CONFIG"] == "/etc/kvhandoff/config.toml"
    assert env["KVHANDOFF_PORT"] == str(port)
    known = {ENV_PREFIX + name.upper() for name in role_fields(role)} | {"KVHANDOFF_CONFIG"}
    assert set(env) <= known, set(env) - known
    pre_stop = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace = tomllib.loads(_config_toml())["service"]["grace_seconds"]
    assert spec["terminationGracePeriodSeconds"] > pre_stop + grace + 10


def test_prefill_service_is_headless_and_decode_targets_it():
    prefill = _find("Service", "kvhandoff-prefill")["spec"]
    decode = _find("Service", "kvhandoff-decode")["spec"]
    assert prefill["clusterIP"] == "None"
    assert decode.get("clusterIP") != "None"
    target = tomllib.loads(_config_toml())["decode"]["prefill_target"]
    assert re.fullmatch(r"dns:///kvhandoff-prefill:50061", target), target
    assert {"name": "grpc", "port": 50061, "targetPort": "grpc"} in prefill["ports"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_configmap_settings_pass_the_services_checks(role, tmp_path, capsys, monkeypatch):
    for name in [n for n in os.environ if n.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)
    path = tmp_path / "config.toml"
    path.write_text(_config_toml())
    assert main(["config", "show", role, "--config", str(path)]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["service"]["model"] == "/models" and config["service"]["host"] == "0.0.0.0"


def _colocated() -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / "colocated.yaml").read_text()) if d]


def test_decode_picks_the_fastest_plane_both_sides_can_use():
    assert tomllib.loads(_config_toml())["decode"]["data_plane"] == "auto"


def test_colocated_pair_shares_one_tmpfs_at_one_path_with_one_uid():
    """The shared-memory plane's needs in one pod: an in-memory emptyDir mounted at the same
    path in both containers and named by both as their shm dir, one uid for both (regions are
    0600, owner-checked), decode dialing prefill on the pod's loopback."""
    (deployment,) = [d for d in _colocated() if d["kind"] == "Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsUser"] == 10001
    volumes = {v["name"]: v for v in spec["volumes"]}
    containers = {c["name"]: c for c in spec["containers"]}
    assert set(containers) == {"prefill", "decode"}
    for name, container in containers.items():
        assert container["command"] == ["kvhandoff", name]
        assert "runAsUser" not in container.get("securityContext", {}), name  # pod's uid
        env = {e["name"]: e["value"] for e in container["env"]}
        known = {ENV_PREFIX + f.upper() for f in role_fields(name)} | {"KVHANDOFF_CONFIG"}
        assert set(env) <= known, set(env) - known
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == env[
            "KVHANDOFF_SHM_DIR"]]
        assert volumes[mount["name"]]["emptyDir"]["medium"] == "Memory"
        assert mount["name"] == "kvh-shm" and not mount.get("readOnly")
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    decode_env = {e["name"]: e["value"] for e in containers["decode"]["env"]}
    assert decode_env["KVHANDOFF_PREFILL_TARGET"] == f"127.0.0.1:{PORTS['prefill']}"
    prefill_env = {e["name"]: e["value"] for e in containers["prefill"]["env"]}
    assert prefill_env["KVHANDOFF_PORT"] == str(PORTS["prefill"])
    (service,) = [d for d in _colocated() if d["kind"] == "Service"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
