"""Checks ray_cluster.yaml before `ray up`: the values that differ between AWS accounts are filled in, well
formed and consistent, and the 8-GPU nodes get the network the cost model assumes (EFA, placement group).

    python deploy/aws/check_cluster.py [ray_cluster.yaml]

Prints one line and exits 0 when the file is ready; else prints one line naming the first value still
unedited or wrong, and exits 2. It reads the file only: whether the subnet, security group, file system and
image exist is for `ray up` (and deploy/aws/network.sh, which made them) to find out.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
PLACEHOLDER = "REPLACE_ME"
# AWS resource ids: a prefix and 8 or 17 hex digits.
ID_FORMS = {
    "subnet": re.compile(r"subnet-(?:[0-9a-f]{8}|[0-9a-f]{17})"),
    "security_group": re.compile(r"sg-(?:[0-9a-f]{8}|[0-9a-f]{17})"),
    "efs": re.compile(r"fs-(?:[0-9a-f]{8}|[0-9a-f]{17})"),
}
REGION = re.compile(r"[a-z]{2}(?:-gov)?-[a-z]+-\d")
IMAGE = re.compile(r"[^\s/]+(?:/[^\s/:]+)+:[\w][\w.-]*")
ECR_REGION = re.compile(r"\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com/")
FORMS = {
    "subnet": "a subnet id (subnet-0123abcd...)",
    "security_group": "a security group id (sg-0123abcd...)",
    "efs": "an EFS file system id (fs-0123abcd...)",
    "image": "an image reference (REGISTRY/REPOSITORY:TAG)",
}
HINTS = {
    "subnet": "the private subnet you gave deploy/aws/network.sh (SUBNET_ID)",
    "security_group": "the security group deploy/aws/network.sh printed",
    "efs": "the EFS file system deploy/aws/network.sh printed",
    "image": "the image you pushed: deploy/aws/network.sh printed its ECR repository",
}


class Unready(Exception):
    """One line: what is still unedited or wrong."""


def _walk(node: Any, path: str = "") -> list[tuple[str, Any]]:
    out = [(path, node)]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _walk(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _walk(v, f"{path}[{i}]")
    return out


def _schema(config: dict[str, Any]) -> None:
    try:
        import jsonschema
        import ray.autoscaler
    except ImportError:  # `ray up` validates it too
        return
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    try:
        jsonschema.validate(config, schema)
    except jsonschema.ValidationError as exc:
        where = ".".join(map(str, exc.absolute_path)) or "the top level"
        raise Unready(f"{where}: {exc.message} (Ray's ray-schema.json)") from None


def _edits(config: dict[str, Any]) -> dict[str, str]:
    edit = (config.get("metadata") or {}).get("edit") or {}
    for key in ("subnet", "security_group", "efs", "image"):
        value = str(edit.get(key) or "")
        if not value:
            raise Unready(f"metadata.edit.{key} is missing: put {HINTS[key]}")
        if PLACEHOLDER in value:
            raise Unready(f"metadata.edit.{key} is still {value}: put {HINTS[key]}")
        if not ID_FORMS.get(key, IMAGE).fullmatch(value):
            raise Unready(f"metadata.edit.{key} is {value!r}, not {FORMS[key]}: put {HINTS[key]}")
    for where, value in _walk(config):
        if isinstance(value, str) and PLACEHOLDER in value:
            raise Unready(f"{where} still holds {PLACEHOLDER}: {value[:80]}")
    return {k: str(edit[k]) for k in ("subnet", "security_group", "efs", "image")}


def _consistent(config: dict[str, Any], edit: dict[str, str]) -> str:
    region = str((config.get("provider") or {}).get("region") or "")
    if not REGION.fullmatch(region):
        raise Unready(f"provider.region is {region!r}, not an AWS region such as us-east-1")
    for where, value in _walk(config.get("available_node_types") or {}):
        key = where.rsplit(".", 1)[-1]
        if key in ("SubnetId", "SubnetIds"):
            ids = value if isinstance(value, list) else [value]
            if any(isinstance(v, str) and v != edit["subnet"] for v in ids):
                raise Unready(f"available_node_types.{where} is {value}, not metadata.edit.subnet")
        groups = [edit["security_group"]]
        if key in ("Groups", "SecurityGroupIds") and isinstance(value, list) and value != groups:
            raise Unready(f"available_node_types.{where} is {value}, not [metadata.edit.security_group]")
    mount = f"{edit['efs']}.efs.{region}.amazonaws.com:/"
    commands = config.get("initialization_commands") or []
    if not any(mount in c for c in commands):
        raise Unready(f"initialization_commands: no mount of {mount} (metadata.edit.efs in provider.region)")
    image = str((config.get("docker") or {}).get("image") or "")
    if image != edit["image"]:
        raise Unready(f"docker.image is {image!r}, not metadata.edit.image {edit['image']}")
    ecr = ECR_REGION.search(image)
    if ecr and ecr.group(1) != region:
        raise Unready(f"docker.image is in {ecr.group(1)}'s ECR, the cluster in provider.region {region}")
    return region


def _network(path: Path, config: dict[str, Any]) -> str:
    sys.path.insert(0, str(ROOT))  # run from a checkout without `pip install -e .` too
    from service.cluster.network import declared_network
    from service.spec.errors import SpecError

    declared = (config.get("metadata") or {}).get("network") or {}
    name = declared.get("node_type")
    try:
        gbps, efa, reason = declared_network(path, name)
    except SpecError as exc:
        raise Unready(str(exc).removeprefix(f"{path}: ")) from None
    if not efa or "metadata.network declares" in reason or gbps <= 0:
        raise Unready(f"metadata.network: {reason}")
    node_config = config["available_node_types"][name]["node_config"]
    group = (node_config.get("Placement") or {}).get("GroupName")
    cluster = config.get("cluster_name", "")
    if group != f"ray-{cluster}" or declared.get("placement_group") != group:
        raise Unready(
            f"available_node_types.{name}.node_config.Placement.GroupName is {group!r}: "
            f"deploy/aws/network.sh makes ray-{cluster}, and metadata.network.placement_group names it"
        )
    for type_name, node in config["available_node_types"].items():
        profile = ((node.get("node_config") or {}).get("IamInstanceProfile") or {}).get("Name")
        want = f"ray-{cluster}-head" if type_name == config.get("head_node_type") else f"ray-{cluster}-node"
        if profile != want:
            raise Unready(
                f"available_node_types.{type_name}.node_config.IamInstanceProfile.Name is {profile!r}: "
                f"deploy/aws/network.sh makes {want}"
            )
    return reason


def _token(config: dict[str, Any]) -> None:
    """The token `file_mounts` copies to every node exists here and only its owner can read it: Ray's
    `get-auth-token --generate` writes it world-readable, and the copy (rsync -a) keeps the mode on each
    node. Whoever holds it can submit jobs: run any code on the cluster."""
    import os
    import stat

    mounts = config.get("file_mounts") or {}
    source = next((v for k, v in mounts.items() if str(k).endswith(".ray/auth_token")), None)
    if source is None:
        return
    local = Path(os.path.expanduser(str(source)))
    if not local.is_file():
        raise Unready(f"file_mounts copies {source}, which does not exist: run "
                      "`(umask 077; ray get-auth-token --generate >/dev/null)`")  # fmt: skip
    mode = stat.S_IMODE(local.stat().st_mode)
    if mode & 0o077:
        raise Unready(f"{source} is readable by other users (mode {mode:04o}), and file_mounts copies it "
                      f"with that mode to every node: chmod 600 {source}")  # fmt: skip


def check(path: Path) -> str:
    """The one-line verdict on `path`; raises `Unready` with the first problem."""
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise Unready(f"cannot read it as YAML ({exc})") from None
    if not isinstance(config, dict):
        raise Unready("not a Ray cluster file")
    _schema(config)
    edit = _edits(config)
    region = _consistent(config, edit)
    network = _network(path, config)
    _token(config)
    values = ", ".join([region, edit["subnet"], edit["security_group"], edit["efs"]])
    return f"ready for `ray up`: {values}; {network}"


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else ROOT / "ray_cluster.yaml"
    try:
        print(f"{path.name}: {check(path)}")
    except Unready as exc:
        print(f"{path.name}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
