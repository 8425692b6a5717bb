"""ray_cluster.yaml: valid against the autoscaler schema Ray ships, the layout issue #9 asks for, every
file and command it names exists, and the security points hold (token auth, loopback-only dashboard
and MLflow, our own security group so Ray never opens SSH to 0.0.0.0/0)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from manifest_checks import (
    ROOT,
    missing_paths,
    open_to_all,
    referenced_paths,
    service_commands,
    unknown_commands,
)

TEXT = (ROOT / "ray_cluster.yaml").read_text()
CONFIG = yaml.safe_load(TEXT)
NODES = CONFIG["available_node_types"]


def _commands(*keys: str) -> str:
    return "\n".join(cmd for key in keys for cmd in CONFIG.get(key, []))


def test_matches_ray_schema():
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(CONFIG, schema)


def test_schema_check_catches_a_bad_field():
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    bad = {**CONFIG, "available_node_types": {**NODES, "head": {**NODES["head"], "max_worker": 1}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_layout_cpu_head_gpu_workers_from_zero():
    assert NODES[CONFIG["head_node_type"]]["resources"] == {"CPU": 0}
    big, small = NODES["gpu-8xh100"], NODES["gpu-1xh100"]
    assert big["node_config"]["InstanceType"] == "p5.48xlarge" and big["resources"]["GPU"] == 8
    assert big["min_workers"] == 0 and big["max_workers"] * big["resources"]["GPU"] == 32
    assert small["min_workers"] == 0 and 0 < small["resources"]["GPU"] < 8
    assert CONFIG["max_workers"] >= big["max_workers"] + small["max_workers"]
    assert 0 < CONFIG["idle_timeout_minutes"] <= 30


def test_setup_installs_the_project_with_cuda_torch():
    setup = _commands("setup_commands", "worker_setup_commands")
    pinned = re.search(r"torch==([\d.]+)", setup)
    project_pin = re.search(r'"torch==([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pinned and project_pin and pinned.group(1) == project_pin.group(1)
    assert "pip install -q -e ~/planner" in setup and CONFIG["file_mounts"]["~/planner"] == "."
    assert "torch.cuda.is_available()" in setup  # a GPU node without CUDA torch fails its setup


def test_shared_storage_not_the_heads_disk():
    init = _commands("initialization_commands")
    assert "mount -t nfs4" in init and "/mnt/shared" in init
    setup = _commands("setup_commands")
    assert "SERVICE_SEARCH_DIR=/mnt/shared/" in setup and "SERVICE_STORAGE_PATH=/mnt/shared/" in setup
    assert "sqlite:////mnt/shared/mlflow/" in _commands("head_start_ray_commands")


def test_token_auth_on_every_node():
    assert CONFIG["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    for cmd in CONFIG["head_start_ray_commands"][:2] + CONFIG["worker_start_ray_commands"]:
        assert cmd.startswith("RAY_AUTH_MODE=token "), cmd


def test_dashboard_job_api_and_mlflow_on_loopback_only():
    head = _commands("head_start_ray_commands")
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head
    assert "mlflow-server --host 127.0.0.1" in head
    assert not open_to_all(TEXT) and not open_to_all(json.dumps(CONFIG))


def test_every_node_type_names_its_security_group():
    # Ray's AWS provider creates a group with SSH from 0.0.0.0/0 for node types without one
    # (ray/autoscaler/_private/aws/config.py, _create_default_ssh_inbound_rules).
    for name, node in NODES.items():
        assert node["node_config"].get("SecurityGroupIds"), name


FAKE_AWS = """#!/usr/bin/env bash
echo "$*" >> "$AWS_CALLS"
case "$2" in
  create-security-group) echo sg-0123 ;;
  create-file-system) echo fs-0456 ;;
  describe-file-systems) echo available ;;
esac
"""


def _network_script(tmp_path: Path, cidr: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """Runs deploy/aws/network.sh with a fake `aws` that records its calls."""
    (tmp_path / "aws").write_text(FAKE_AWS)
    (tmp_path / "aws").chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "AWS_CALLS": str(calls),
           "ADMIN_CIDR": cidr, "VPC_ID": "vpc-1", "SUBNET_ID": "subnet-1"}  # fmt: skip
    proc = subprocess.run(["bash", str(ROOT / "deploy/aws/network.sh")], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    return proc, calls.read_text() if calls.exists() else ""


def test_network_script_opens_ssh_to_the_admin_cidr_only(tmp_path: Path):
    proc, calls = _network_script(tmp_path, "203.0.113.7/32")
    assert proc.returncode == 0, proc.stderr
    assert "CidrIp=203.0.113.7/32" in calls and "UserIdGroupPairs=[{GroupId=sg-0123}]" in calls
    assert "create-mount-target" in calls and "fs-0456" in proc.stdout
    assert not open_to_all(calls)


@pytest.mark.parametrize("cidr", ["0.0.0.0/0", "::/0"])
def test_network_script_refuses_an_open_cidr(tmp_path: Path, cidr: str):
    proc, calls = _network_script(tmp_path, cidr)
    assert proc.returncode == 2 and "refusing" in proc.stderr and calls == ""


def test_referenced_files_and_commands_exist():
    assert "deploy/aws/network.sh" in referenced_paths(TEXT)
    assert "search_spaces/llama2-13b-32xh100.yaml" in referenced_paths(TEXT)
    assert missing_paths(TEXT) == []
    assert {"mlflow-server", "search", "submit"} <= set(service_commands(TEXT))
    assert unknown_commands(TEXT) == []


def test_most_gpus_the_autoscaler_can_bring_up():
    from service.cluster.capacity import most_from_config

    # 4 × 8 + 4 × 1 GPU workers within max_workers 8; the head has none.
    assert most_from_config(CONFIG, "GPU") == 36
    capped = {**CONFIG, "max_workers": 5}
    assert most_from_config(capped, "GPU") == 33  # the largest nodes first: 4 × 8 + 1
