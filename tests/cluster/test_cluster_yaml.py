"""ray_cluster.yaml: valid against the autoscaler schema Ray ships, the layout issue #9 asks for, every
file and command it names exists, and the security points hold (token auth, loopback-only dashboard
and MLflow, our own security group so Ray never opens SSH to 0.0.0.0/0). The network issue #34 asks for:
32 EFA interfaces on each p5.48xlarge in a cluster placement group, in the image of deploy/Dockerfile
(Python 3.11, the project installed once, the EFA userspace); deploy/aws/check_cluster.py names what is
still unedited."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
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
from packaging.specifiers import SpecifierSet

TEXT = (ROOT / "ray_cluster.yaml").read_text()
CONFIG = yaml.safe_load(TEXT)
NODES = CONFIG["available_node_types"]
DOCKERFILE = (ROOT / "deploy/Dockerfile").read_text()
PYPROJECT = (ROOT / "pyproject.toml").read_text()


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


def test_every_node_runs_the_image_and_installs_nothing():
    from ray.autoscaler._private.util import prepare_config

    assert CONFIG["docker"]["image"] == CONFIG["metadata"]["edit"]["image"]
    # With Ray's defaults filled in (a missing head_setup_commands would pip-install boto3).
    prepared = prepare_config(copy.deepcopy(CONFIG))
    commands = json.dumps({k: v for k, v in prepared.items() if k.endswith("_commands")})
    assert "pip install" not in commands  # the project is in the image, installed once
    assert "~/planner" not in CONFIG["file_mounts"]  # jobs bring the checkout (submit --working-dir)
    assert "torch.cuda.is_available()" in _commands("worker_setup_commands")  # a GPU node without CUDA fails


def test_the_image_has_python_311_the_pinned_project_and_efa():
    base = re.search(r"^FROM rayproject/ray:([\d.]+)-py(\d)(\d+)-gpu$", DOCKERFILE, flags=re.M)
    assert base, "deploy/Dockerfile: FROM rayproject/ray:<ray>-py<major><minor>-gpu"
    requires = re.search(r'^requires-python = "([^"]+)"', PYPROJECT, flags=re.M)
    assert requires and SpecifierSet(requires.group(1)).contains(f"{base.group(2)}.{base.group(3)}")
    ray_pin = re.search(r'"ray\[[\w,]+\]==([\d.]+)"', PYPROJECT)
    assert ray_pin and base.group(1) == ray_pin.group(1)  # Ray's image for the Ray release pyproject pins
    torch_pin = re.search(r'"torch==([\d.]+)"', PYPROJECT)
    assert torch_pin and f"torch=={torch_pin.group(1)}" in DOCKERFILE
    assert DOCKERFILE.count("pip install --no-cache-dir -e .") == 1  # the project, once
    # EFA as AWS documents it for containers, and NCCL pointed at it.
    assert "./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify" in DOCKERFILE
    assert "/opt/amazon/ofi-nccl/lib" in DOCKERFILE and "FI_PROVIDER=efa" in DOCKERFILE
    assert "FI_EFA_USE_DEVICE_RDMA=1" in DOCKERFILE
    assert "--ulimit memlock=-1:-1" in CONFIG["docker"]["run_options"]


def test_8_gpu_nodes_get_32_efa_interfaces_in_a_placement_group():
    node = NODES["gpu-8xh100"]
    config = node["node_config"]
    interfaces = config["NetworkInterfaces"]
    # AWS for P5: one EFA per network card, card 0 at device index 0, cards 1-31 at device index 1.
    assert [ni["NetworkCardIndex"] for ni in interfaces] == list(range(32))
    assert [ni["DeviceIndex"] for ni in interfaces] == [0] + [1] * 31
    assert {ni["InterfaceType"] for ni in interfaces} == {"efa"}
    edit = CONFIG["metadata"]["edit"]
    assert all(
        ni["SubnetId"] == edit["subnet"] and ni["Groups"] == [edit["security_group"]] for ni in interfaces
    )
    assert config["Placement"]["GroupName"] == CONFIG["metadata"]["network"]["placement_group"]
    assert node["docker"]["worker_run_options"] == ["--device=/dev/infiniband"]
    assert "fi_info -p efa" in _commands("worker_setup_commands")  # an 8-GPU node without EFA fails its setup


def test_ray_accepts_the_network_interfaces():
    # What `ray up` does with them first (no AWS call): subnets and groups move to the node type's
    # SubnetIds and SecurityGroupIds, which must not be set beside NetworkInterfaces.
    from ray.autoscaler._private.aws.config import _configure_from_network_interfaces

    configured = _configure_from_network_interfaces(copy.deepcopy(CONFIG))
    node_config = configured["available_node_types"]["gpu-8xh100"]["node_config"]
    assert set(node_config["SubnetIds"]) == {CONFIG["metadata"]["edit"]["subnet"]}
    assert set(node_config["SecurityGroupIds"]) == {CONFIG["metadata"]["edit"]["security_group"]}


def test_placeholders_are_few_and_written_once():
    code = "\n".join(line.split(" #")[0] for line in TEXT.splitlines() if not line.lstrip().startswith("#"))
    # subnet, security group, EFS (metadata.edit and the mount command) and image: nothing else to edit.
    assert code.count("REPLACE_ME") == 5
    assert set(CONFIG["metadata"]["edit"]) == {"subnet", "security_group", "efs", "image"}
    assert "availability_zone" not in CONFIG["provider"]  # the subnet decides it


def test_shared_storage_not_the_heads_disk():
    init = _commands("initialization_commands")
    assert "mount -t nfs4" in init and "/mnt/shared" in init
    # The NFS client is installed before the mount, and the image's user (uid 1000) can write.
    assert init.index("nfs-common") < init.index("mount -t nfs4")
    assert "chown 1000:100 /mnt/shared/ray_results /mnt/shared/mlflow" in init
    assert "-v /mnt/shared:/mnt/shared" in CONFIG["docker"]["run_options"]
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
        interfaces = node["node_config"].get("NetworkInterfaces", [])
        assert node["node_config"].get("SecurityGroupIds") or (
            interfaces and all(ni.get("Groups") for ni in interfaces)
        ), name


FAKE_AWS = """#!/usr/bin/env bash
echo "$*" >> "$AWS_CALLS"
case "$2" in
  create-security-group) echo sg-0123 ;;
  create-file-system) echo fs-0456 ;;
  describe-file-systems) echo available ;;
  create-repository) echo 123456789012.dkr.ecr.us-east-1.amazonaws.com/planner ;;
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


def test_network_script_makes_what_the_cluster_file_names(tmp_path: Path):
    proc, calls = _network_script(tmp_path, "10.0.0.10/32")
    assert proc.returncode == 0, proc.stderr
    lines = calls.splitlines()
    # EFA: all traffic within the group, both ways.
    assert any(
        "authorize-security-group-egress" in c and "UserIdGroupPairs=[{GroupId=sg-0123}]" in c for c in lines
    )
    group = CONFIG["metadata"]["network"]["placement_group"]
    assert f"create-placement-group --region us-east-1 --group-name {group} --strategy cluster" in calls
    for node in NODES.values():
        assert f"--instance-profile-name {node['node_config']['IamInstanceProfile']['Name']}" in calls
    assert "create-repository --region us-east-1 --repository-name planner" in calls
    assert "123456789012.dkr.ecr.us-east-1.amazonaws.com/planner:0.1.0" in proc.stdout


@pytest.mark.parametrize("cidr", ["0.0.0.0/0", "::/0"])
def test_network_script_refuses_an_open_cidr(tmp_path: Path, cidr: str):
    proc, calls = _network_script(tmp_path, cidr)
    assert proc.returncode == 2 and "refusing" in proc.stderr and calls == ""


def test_referenced_files_and_commands_exist():
    assert {"deploy/aws/network.sh", "deploy/aws/check_cluster.py"} <= set(referenced_paths(TEXT))
    assert "deploy/Dockerfile" in TEXT and (ROOT / "deploy/Dockerfile").is_file()  # outside _PATH's forms
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


FILLED = {"subnet-REPLACE_ME": "subnet-0123456789abcdef0", "sg-REPLACE_ME": "sg-0123456789abcdef0",
          "fs-REPLACE_ME": "fs-0123456789abcdef0", "REPLACE_ME.dkr": "123456789012.dkr"}  # fmt: skip


def _check(tmp_path: Path, text: str, token_mode: int | None = 0o600) -> subprocess.CompletedProcess[str]:
    """Runs deploy/aws/check_cluster.py on `text` as a cluster file, for a user whose ~/.ray/auth_token has
    `token_mode` (None: no token)."""
    path = tmp_path / "ray_cluster.yaml"
    path.write_text(text)
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True, exist_ok=True)
    token = home / ".ray" / "auth_token"
    token.unlink(missing_ok=True)
    if token_mode is not None:
        token.write_text("0123456789abcdef")
        token.chmod(token_mode)
    env = {**os.environ, "HOME": str(home)}
    return subprocess.run([sys.executable, str(ROOT / "deploy/aws/check_cluster.py"), str(path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)  # fmt: skip


def _filled(changes: dict[str, str] | None = None) -> str:
    """The shipped file with `changes` made, then every placeholder filled in."""
    text = TEXT
    for old, new in [*(changes or {}).items(), *FILLED.items()]:
        text = text.replace(old, new)
    return text


def test_check_names_the_first_unedited_value(tmp_path: Path):
    proc = _check(tmp_path, TEXT)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "ray_cluster.yaml: metadata.edit.subnet is still subnet-REPLACE_ME: put the private subnet you gave "
        "deploy/aws/network.sh (SUBNET_ID)"
    ]
    proc = _check(tmp_path, TEXT.replace("subnet-REPLACE_ME", FILLED["subnet-REPLACE_ME"]))
    assert "metadata.edit.security_group is still sg-REPLACE_ME" in proc.stderr


def test_check_passes_a_filled_in_file(tmp_path: Path):
    proc = _check(tmp_path, _filled())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ray_cluster.yaml: ready for `ray up`: us-east-1, subnet-0123456789abcdef0")
    assert "32 EFA interfaces × 100 Gb/s = 3,200 Gb/s per node, in placement group ray-planner" in proc.stdout


def test_check_refuses_a_token_others_can_read_or_none(tmp_path: Path):
    proc = _check(tmp_path, _filled(), token_mode=0o644)  # as `ray get-auth-token --generate` writes it
    assert proc.returncode == 2
    assert "~/.ray/auth_token is readable by other users (mode 0644)" in proc.stderr
    assert "chmod 600 ~/.ray/auth_token" in proc.stderr
    proc = _check(tmp_path, _filled(), token_mode=None)
    assert proc.returncode == 2 and "which does not exist: run `(umask 077;" in proc.stderr


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"fs-REPLACE_ME": "fs-12"}, "metadata.edit.efs is 'fs-12', not an EFS file system id"),
        ({"region: us-east-1": "region: eu-west-1"}, "no mount of fs-0123456789abcdef0.efs.eu-west-1"),
        (
            {"REPLACE_ME.dkr.ecr.us-east-1": "123456789012.dkr.ecr.us-west-2"},
            "docker.image is in us-west-2's ECR",
        ),
        ({"GroupName: ray-planner}": "GroupName: other}"}, "Placement.GroupName is 'other'"),
        (
            {"InterfaceType: efa,": "InterfaceType: interface,"},
            "no EFA interfaces, so NCCL falls back to TCP",
        ),
        ({"{Name: ray-planner-node} # pulls": "{Name: mine} # pulls"}, "IamInstanceProfile.Name is 'mine'"),
    ],
)
def test_check_names_what_is_wrong(tmp_path: Path, changes: dict[str, str], named: str):
    proc = _check(tmp_path, _filled(changes))
    assert proc.returncode == 2 and named in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
