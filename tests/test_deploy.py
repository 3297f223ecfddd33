"""deploy/: cluster YAMLs pass Ray's own config validation; resources are where we expect.

The cluster-launcher configs go through ``prepare_config`` (defaults, legacy rewrite,
per-type worker bounds; what ``ray up`` does before talking to a cloud) and then
``validate_config`` (Ray's JSON schema plus its consistency checks). The KubeRay manifest
goes through the function the KubeRay autoscaler uses to read a RayCluster, which also
validates the result.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import stat
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.kuberay.autoscaling_config import (
    _derive_autoscaling_config_from_ray_cr,
)
from ray.autoscaler._private.util import prepare_config, validate_config

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
ARCHITECTURE = DEPLOY.parent / "docs" / "architecture.md"
PROCESS_ENVIRONMENT = "Process environment"  # the section of ARCHITECTURE the deploy files cite


def _load(name: str) -> dict[str, Any]:
    data = yaml.safe_load((DEPLOY / name).read_text())
    assert isinstance(data, dict)
    return data


def _prepared(config: dict[str, Any]) -> dict[str, Any]:
    prepared = prepare_config(config)
    validate_config(prepared)
    return prepared


def _resources_flag(command: str) -> dict[str, int]:
    flags = [arg for arg in shlex.split(command) if arg.startswith("--resources=")]
    assert len(flags) == 1, command
    return json.loads(flags[0].removeprefix("--resources="))


def _write_script(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


# ---------------------------------------------------------------- local provider


def test_local_cluster_validates_with_ray() -> None:
    prepared = _prepared(_load("cluster.yaml"))

    assert prepared["provider"] == {
        "type": "local",
        "head_ip": "10.0.0.10",
        "worker_ips": ["10.0.0.11", "10.0.0.12"],
    }
    assert prepared["head_node_type"] == "local.cluster.node"
    assert prepared["available_node_types"] == {
        "local.cluster.node": {
            "node_config": {},
            "resources": {},
            "min_workers": 2,
            "max_workers": 2,
        }
    }
    assert prepared["file_mounts"] == {"~/kvstrata": ".", "~/.ray/auth_token": "~/.ray/auth_token"}
    assert "~/kvstrata-venv/bin/pip install -q -e ~/kvstrata" in prepared["worker_setup_commands"]


def test_local_head_offers_one_spill_node() -> None:
    head_start = _load("cluster.yaml")["head_start_ray_commands"]
    assert head_start[0] == "ray stop"
    assert _resources_flag(head_start[-1]) == {"spill_node": 1}


@pytest.mark.parametrize(("gpu_lines", "cache_nodes"), [(0, 1), (1, 1), (4, 4)])
def test_local_worker_offers_one_cache_node_per_gpu(
    tmp_path: Path, gpu_lines: int, cache_nodes: int
) -> None:
    """Runs the worker start command with stub `nvidia-smi` and `ray` executables."""
    listing = "".join(f"GPU {i}: NVIDIA A10G\\n" for i in range(gpu_lines))
    _write_script(tmp_path / "nvidia-smi", f"printf '{listing}'" if gpu_lines else "exit 9")
    _write_script(tmp_path / "ray", "printf '%s\\n' \"$@\"")
    command = _load("cluster.yaml")["worker_start_ray_commands"][-1]

    result = subprocess.run(
        ["bash", "-c", command],
        env={"PATH": f"{tmp_path}:{os.environ['PATH']}", "RAY_HEAD_IP": "10.0.0.10"},
        capture_output=True,
        text=True,
        check=True,
    )

    assert result.stdout.splitlines() == [
        "start",
        "--address=10.0.0.10:6379",
        f'--resources={{"cache_node": {cache_nodes}}}',
    ]


# ---------------------------------------------------------------- AWS


def test_aws_cluster_validates_with_ray() -> None:
    prepared = _prepared(_load("cluster-aws.yaml"))

    node_types = prepared["available_node_types"]
    assert prepared["head_node_type"] == "head"
    assert {name: t["resources"] for name, t in node_types.items()} == {
        "head": {"CPU": 8},
        "gpu_cache": {"CPU": 8, "GPU": 1, "cache_node": 1},
        "cpu_spill": {"CPU": 8, "spill_node": 1},
    }
    assert {name: (t["min_workers"], t["max_workers"]) for name, t in node_types.items()} == {
        "head": (0, 0),
        "gpu_cache": (1, 4),
        "cpu_spill": (1, 4),
    }
    assert node_types["gpu_cache"]["node_config"]["InstanceType"] == "g5.2xlarge"
    assert prepared["max_workers"] == 8
    assert prepared["head_setup_commands"][-1].startswith("~/kvstrata-venv/bin/pip install")


def test_ray_validation_rejects_a_broken_config() -> None:
    """The validation above can fail: a node type without `resources` is refused."""
    config = copy.deepcopy(_load("cluster-aws.yaml"))
    del config["available_node_types"]["gpu_cache"]["resources"]

    with pytest.raises(jsonschema.ValidationError, match="'resources' is a required property"):
        _prepared(config)


# ---------------------------------------------------------------- KubeRay


def test_kuberay_manifest_carries_the_resources() -> None:
    manifest = _load("kuberay-raycluster.yaml")
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayCluster")

    autoscaling = _derive_autoscaling_config_from_ray_cr(manifest)

    gib = 1 << 30
    assert {
        name: (t["resources"], t["min_workers"], t["max_workers"])
        for name, t in autoscaling["available_node_types"].items()
    } == {
        "headgroup": ({"CPU": 4, "memory": 16 * gib}, 0, 0),
        "gpu-cache": ({"CPU": 8, "GPU": 1, "memory": 32 * gib, "cache_node": 1}, 1, 4),
        "cpu-spill": ({"CPU": 4, "memory": 64 * gib, "spill_node": 1}, 1, 4),
    }
    assert autoscaling["max_workers"] == 8
    assert manifest["spec"]["rayVersion"] == "2.60.0"


def _architecture_section(name: str) -> str:
    """The body of the ``## <name>`` section of docs/architecture.md ("" when there is none)."""
    text, heading = ARCHITECTURE.read_text(), f"\n## {name}\n"
    if heading not in text:
        return ""
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-aws.yaml"])
def test_launcher_configs_cite_the_architecture_section_they_follow(name: str) -> None:
    """issue 19: the setup comment cited a section of a design document that is not in the
    repository; it now names a section of docs/architecture.md, which exists and says why RAY_AUTH_MODE is
    set alike everywhere."""
    text = (DEPLOY / name).read_text()
    assert "DESIGN" + ".md" not in text
    assert f"# (docs/architecture.md, '{PROCESS_ENVIRONMENT}')" in text
    section = _architecture_section(PROCESS_ENVIRONMENT)
    assert "RAY_AUTH_MODE" in section, f"docs/architecture.md has no section {PROCESS_ENVIRONMENT!r}"


# ---------------------------------------------------------------- Ray token authentication
#
# Regression (review 23d, A): every deploy file ran Ray with RAY_AUTH_MODE=disabled, so whoever
# reached the GCS or client port (any pod, any host of the network) ran code on the cluster and
# read the admin key, the tenant store and the CURVE keys.

RAY_TOKEN_SECRET = {"name": "kvstrata-ray-auth", "key": "auth_token"}
"""The Kubernetes Secret (and its key) the operator creates with Ray's token."""

_AUTH_MODE = re.compile(r"RAY_AUTH_MODE\s*(?:=|,\s*value:)\s*[\"']?([A-Za-z_]*)")


def auth_modes(text: str) -> list[str]:
    """Every value a deploy file gives ``RAY_AUTH_MODE`` (shell or Dockerfile ``=``, a
    Kubernetes ``{name: RAY_AUTH_MODE, value: ...}``)."""
    return _AUTH_MODE.findall(text)


def kuberay_auth_problems(manifest: dict[str, Any]) -> list[str]:
    """What in a RayCluster leaves a Ray process without token auth: each container and the
    autoscaler need RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from ``RAY_TOKEN_SECRET`` (a
    secretKeyRef, never a literal)."""
    spec = manifest["spec"]
    envs = {group.get("groupName", "head"): env
            for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
            for env in [c.get("env", []) for c in group["template"]["spec"]["containers"]]}
    envs["autoscaler"] = spec.get("autoscalerOptions", {}).get("env", [])
    problems = []
    for where, env in envs.items():
        items = {item["name"]: item for item in env}
        if items.get("RAY_AUTH_MODE", {}).get("value") != "token":
            problems.append(f"{where}: RAY_AUTH_MODE is not token")
        token = items.get("RAY_AUTH_TOKEN", {})
        if "value" in token or token.get("valueFrom", {}).get("secretKeyRef") != RAY_TOKEN_SECRET:
            problems.append(f"{where}: RAY_AUTH_TOKEN is not from the Secret {RAY_TOKEN_SECRET}")
    return problems


def test_no_deploy_file_runs_ray_without_token_auth() -> None:
    """Every deploy file that sets RAY_AUTH_MODE sets it to token, and every file that starts
    Ray sets it (the README names no other mode either)."""
    for path in sorted(DEPLOY.iterdir()):
        if path.is_file():
            assert set(auth_modes(path.read_text())) <= {"token"}, path.name
    for name in ("cluster.yaml", "cluster-aws.yaml", "kuberay-raycluster.yaml", "Dockerfile"):
        assert auth_modes((DEPLOY / name).read_text()), name


def test_the_auth_mode_check_finds_a_disabled_setting() -> None:
    """The checks above can fail: each way a deploy file sets the mode, set to disabled."""
    assert auth_modes("export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0") == ["disabled"]
    assert auth_modes("ENV RAY_AUTH_MODE=disabled \\") == ["disabled"]
    assert auth_modes("- {name: RAY_AUTH_MODE, value: disabled}") == ["disabled"]
    assert auth_modes('- {name: RAY_AUTH_MODE, value: "token"}') == ["token"]
    manifest = _load("kuberay-raycluster.yaml")
    manifest["spec"]["workerGroupSpecs"][1]["template"]["spec"]["containers"][0]["env"][0]["value"] = "disabled"
    del manifest["spec"]["autoscalerOptions"]["env"]
    manifest["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"][1] = {
        "name": "RAY_AUTH_TOKEN", "value": "a-token-in-the-manifest"}
    assert kuberay_auth_problems(manifest) == [
        "head: RAY_AUTH_TOKEN is not from the Secret " + str(RAY_TOKEN_SECRET),
        "cpu-spill: RAY_AUTH_MODE is not token",
        "autoscaler: RAY_AUTH_MODE is not token",
        "autoscaler: RAY_AUTH_TOKEN is not from the Secret " + str(RAY_TOKEN_SECRET),
    ]


def test_kuberay_containers_and_autoscaler_take_the_token_from_the_secret() -> None:
    """Every process must agree on RAY_AUTH_MODE (docs/architecture.md, 'Process environment'):
    token everywhere, the token from the Secret the README has the operator create."""
    assert "RAY_AUTH_MODE" in _architecture_section(PROCESS_ENVIRONMENT)
    assert kuberay_auth_problems(_load("kuberay-raycluster.yaml")) == []
    readme = (DEPLOY / "README.md").read_text()
    create = (f"kubectl -n kvstrata create secret generic {RAY_TOKEN_SECRET['name']} \\\n"
              f"  --from-literal={RAY_TOKEN_SECRET['key']}=")
    assert create in readme


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-aws.yaml"])
def test_launcher_setup_gives_every_shell_token_auth_with_the_mounted_token(tmp_path: Path, name: str) -> None:
    """The `ray up` setup commands, run in a scratch home that already has the old
    ``RAY_AUTH_MODE=disabled`` line of an earlier deploy in its .bashrc: a login shell (as
    Ray's command runner uses for `ray start`) gets RAY_AUTH_MODE=token and the token file
    that file_mounts copies, mode 0600."""
    config = _load(name)
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("0" * 64)
    token.chmod(0o644)
    (tmp_path / ".bashrc").write_text("source ~/kvstrata-venv/bin/activate\n"
                                      "export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1\n")
    env = {"HOME": str(tmp_path), "PATH": os.environ["PATH"]}
    for command in config["setup_commands"]:
        if "auth_token" in command or "kvstrata_env" in command:
            subprocess.run(["bash", "-c", command], env=env, check=True)
    shell = subprocess.run(["bash", "-c", "source ~/.bashrc 2>/dev/null; echo $RAY_AUTH_MODE $RAY_AUTH_TOKEN_PATH"],
                           env=env, capture_output=True, text=True, check=True)
    assert shell.stdout.split() == ["token", str(token)]
    assert stat.S_IMODE(token.stat().st_mode) == 0o600


def test_readme_walks_through_a_real_cluster() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for step in (
        "ray up deploy/cluster.yaml",
        "kvstrata up --address auto",
        "kvstrata tenant add",
        "kvstrata generate",
        "kubectl apply -f deploy/kuberay-raycluster.yaml",
    ):
        assert step in readme, step


# ---------------------------------------------------------------- Ray dashboard exposure


def _head_start_commands(name: str) -> list[str]:
    return [c for c in _load(name)["head_start_ray_commands"] if "ray start --head" in c]


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-aws.yaml"])
def test_launcher_configs_bind_the_dashboard_to_loopback(name: str) -> None:
    """issue 18 fault 9: the dashboard (its job API runs code) listened on 0.0.0.0, unauthenticated."""
    (command,) = _head_start_commands(name)
    hosts = [arg for arg in shlex.split(command) if arg.startswith("--dashboard-host")]
    assert hosts == ["--dashboard-host=127.0.0.1"], command


def test_kuberay_binds_the_dashboard_to_loopback_and_exposes_no_dashboard_port() -> None:
    """issue 18 fault 9: KubeRay's default dashboard host is 0.0.0.0; the manifest overrides it
    and neither the container nor the head service offers port 8265."""
    head = _load("kuberay-raycluster.yaml")["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    (container,) = head["template"]["spec"]["containers"]
    assert 8265 not in [p["containerPort"] for p in container["ports"]]
    assert "dashboard" not in [p["name"] for p in container["ports"]]


def test_no_deploy_file_binds_anything_to_all_interfaces() -> None:
    """issue 18 fault 9: no deploy file (Dockerfile included) binds to 0.0.0.0."""
    for path in sorted(DEPLOY.iterdir()):
        if path.is_file():
            assert "0.0.0.0" not in path.read_text(), path.name


def test_readme_says_how_to_reach_the_dashboard() -> None:
    """issue 18 fault 9: users reach the loopback-bound dashboard through a tunnel."""
    readme = (DEPLOY / "README.md").read_text()
    for step in ("ray dashboard deploy/cluster.yaml", "--dashboard-host=127.0.0.1",
                 "kubectl -n kvstrata port-forward pod/"):
        assert step in readme, step
