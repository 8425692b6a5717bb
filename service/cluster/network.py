"""What inter-node network a cluster file can deliver per node, read from the file itself.

The cost model prices a p5.48xlarge node's inter-node traffic at 3,200 Gb/s: 32 EFA interfaces, one per
network card, 100 Gb/s each. A cluster file delivers that only when it gives the node those interfaces;
without them NCCL falls back to TCP sockets over the node's primary ENA interface, which sits on one
network card, and the node gets at most that card's 100 Gb/s (single TCP flows less still). So the
bandwidth is counted here, from the node type's EFA interfaces, not taken on trust:

- a Ray autoscaler file (ray_cluster.yaml): the `NetworkInterfaces` of the node type's `node_config`
  whose `InterfaceType` is `efa` or `efa-only`, one per network card, and its cluster placement group;
- a KubeRay manifest (deploy/kuberay/rayjob.yaml): the worker group's `vpc.amazonaws.com/efa` request
  (the AWS EFA device plugin's resource) and the instance type of its nodeSelector.

When the file also declares the network (ray_cluster.yaml's `metadata.network`), a declaration the node
type cannot deliver is said in the reason. Pure: reads the file, no AWS call.

>>> gbps, efa, reason = declared_network("ray_cluster.yaml")
>>> gbps, efa
(3200.0, True)
>>> reason
'gpu-8xh100 (p5.48xlarge): 32 EFA interfaces × 100 Gb/s = 3,200 Gb/s per node, in placement group ray-planner'
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from service.spec.errors import SpecError

EFA_TYPES = ("efa", "efa-only")  # "efa": EFA with ENA; "efa-only": the EFA device without an IP interface
# The AWS EFA device plugin's resource: https://docs.aws.amazon.com/eks/latest/userguide/device-management-efa.html
EFA_RESOURCE = "vpc.amazonaws.com/efa"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"


@dataclass(frozen=True)
class InstanceNetwork:
    """An instance type's network cards: at most one EFA per card, `gbps_per_card` each."""

    network_cards: int
    gbps_per_card: float

    @property
    def efa_gbps(self) -> float:
        return self.network_cards * self.gbps_per_card

    @property
    def ena_gbps(self) -> float:
        """NCCL over TCP on the primary ENA interface: one card's bandwidth at most."""
        return self.gbps_per_card


# "P5 and P5e instances support up to 32 network cards and can provide up to 3,200 Gbps of network
# bandwidth", one EFA per card (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html).
INSTANCES: dict[str, InstanceNetwork] = {
    "p5.48xlarge": InstanceNetwork(network_cards=32, gbps_per_card=100.0),
    "p5e.48xlarge": InstanceNetwork(network_cards=32, gbps_per_card=100.0),
}

# Single TCP flows between instances: 5 Gb/s, 10 Gb/s inside one cluster placement group
# (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/ec2-instance-network-bandwidth.html).
SINGLE_FLOW_GBPS = 5.0
SINGLE_FLOW_PLACEMENT_GROUP_GBPS = 10.0


@dataclass(frozen=True)
class _NodeType:
    name: str
    instance_type: str
    efa_cards: int  # EFA interfaces, one per network card
    placement_group: str | None  # None: not known from this file (KubeRay: the node group's business)
    placement_known: bool


def declared_network(cluster_yaml_path: str | Path, node_type: str | None = None) -> tuple[float, bool, str]:
    """(Gb/s per node between nodes, whether EFA is configured, why) for the node type of `cluster_yaml_path`
    that multi-node runs use: `node_type` if given, else the file's `metadata.network.node_type`, else the
    node type (worker group) with the most GPUs. A `SpecError` names a file or node type it cannot read."""
    path = Path(cluster_yaml_path)
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError("(top level)", f"cannot read it as YAML ({exc})", str(path)) from exc
    ray_config = next((d for d in docs if "available_node_types" in d), None)
    rayjob = next((d for d in docs if d.get("kind") in ("RayJob", "RayCluster")), None)
    if ray_config is not None:
        declared = (ray_config.get("metadata") or {}).get("network") or {}
        node = _ray_node_type(path, ray_config, node_type or declared.get("node_type"))
        if declared.get("node_type", node.name) != node.name:  # a declaration about another node type
            declared = {}
    elif rayjob is not None:
        declared = {}
        node = _kuberay_group(path, rayjob, node_type)
    else:
        raise SpecError("(top level)", "neither a Ray cluster file nor a RayJob/RayCluster", str(path))
    gbps, efa, reason = _deliverable(node)
    if gbps is None:  # an instance type without documented network cards: the declaration, unchecked
        said = _number(declared.get("gbps_per_node"))
        if said is None:
            return 0.0, efa, f"{reason}; no bandwidth declared either"
        declared_efa = bool(declared.get("efa", efa))
        return said, declared_efa, f"{reason}; {said:,.0f} Gb/s as metadata.network declares"
    mismatch = _mismatch(declared, gbps, efa)
    return gbps, efa, f"{reason}; {mismatch}" if mismatch else reason


def _number(value: Any) -> float | None:
    try:
        return None if value is None or isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        return None


def _gpus(resources: dict[str, Any]) -> float:
    try:
        return float(resources.get("GPU") or resources.get("nvidia.com/gpu") or 0)
    except (TypeError, ValueError):
        return 0.0


def _ray_node_type(path: Path, config: dict[str, Any], name: str | None) -> _NodeType:
    types: dict[str, Any] = config.get("available_node_types") or {}
    if name is None:
        workers = {k: v for k, v in types.items() if k != config.get("head_node_type")}
        if not workers:
            raise SpecError("available_node_types", "no worker node type", str(path))
        name = max(workers, key=lambda k: _gpus(workers[k].get("resources") or {}))
    if name not in types:
        raise SpecError("available_node_types", f"no node type {name!r} (has {', '.join(types)})", str(path))
    node_config = types[name].get("node_config") or {}
    cards = {
        ni.get("NetworkCardIndex", 0)
        for ni in node_config.get("NetworkInterfaces") or []
        if str(ni.get("InterfaceType", "")).lower() in EFA_TYPES
    }
    group = (node_config.get("Placement") or {}).get("GroupName")
    return _NodeType(name, str(node_config.get("InstanceType", "")), len(cards), group, placement_known=True)


def _kuberay_group(path: Path, doc: dict[str, Any], name: str | None) -> _NodeType:
    spec = doc.get("spec") or {}
    cluster = spec.get("rayClusterSpec", spec)
    groups = {g.get("groupName"): g for g in cluster.get("workerGroupSpecs") or []}
    if not groups:
        raise SpecError("spec.rayClusterSpec.workerGroupSpecs", "no worker group", str(path))

    def container(group: dict[str, Any]) -> dict[str, Any]:
        containers = ((group.get("template") or {}).get("spec") or {}).get("containers") or [{}]
        return containers[0]

    def limits(group: dict[str, Any]) -> dict[str, Any]:
        return (container(group).get("resources") or {}).get("limits") or {}

    if name is None:
        name = max(groups, key=lambda k: _gpus(limits(groups[k])))
    if name not in groups:
        raise SpecError(
            "spec.rayClusterSpec.workerGroupSpecs",
            f"no worker group {name!r} (has {', '.join(map(str, groups))})",
            str(path),
        )
    group = groups[name]
    selector = ((group.get("template") or {}).get("spec") or {}).get("nodeSelector") or {}
    efa = int(limits(group).get(EFA_RESOURCE, 0) or 0)
    return _NodeType(name, str(selector.get(INSTANCE_TYPE_LABEL, "")), efa, None, placement_known=False)


def _deliverable(node: _NodeType) -> tuple[float | None, bool, str]:
    where = f"{node.name} ({node.instance_type or 'no instance type'})"
    spec = INSTANCES.get(node.instance_type)
    if spec is None:
        known = ", ".join(INSTANCES)
        return None, node.efa_cards > 0, f"{where}: network cards not documented here (only {known})"
    if node.efa_cards == 0:
        in_group, alone = SINGLE_FLOW_PLACEMENT_GROUP_GBPS, SINGLE_FLOW_GBPS
        if node.placement_group:
            flows = f"{in_group:g} Gb/s"
        elif node.placement_known:
            flows = f"{alone:g} Gb/s"
        else:
            flows = f"{alone:g} Gb/s, {in_group:g} in a cluster placement group"
        reason = (
            f"{where}: no EFA interfaces, so NCCL falls back to TCP sockets on the primary ENA interface, "
            f"one of {spec.network_cards} network cards: at most {spec.ena_gbps:,.0f} Gb/s per node (single "
            f"TCP flows {flows}), not the {spec.efa_gbps:,.0f} Gb/s of {spec.network_cards} EFA interfaces"
        )
        return spec.ena_gbps, False, reason
    used = min(node.efa_cards, spec.network_cards)
    gbps = used * spec.gbps_per_card
    reason = f"{where}: {used} EFA interfaces × {spec.gbps_per_card:g} Gb/s = {gbps:,.0f} Gb/s per node"
    if used < spec.network_cards:
        reason += f" ({spec.network_cards} network cards; {spec.efa_gbps:,.0f} Gb/s with one EFA on each)"
    if node.placement_group:
        reason += f", in placement group {node.placement_group}"
    elif node.placement_known:
        reason += ", in no cluster placement group (nodes may land far apart: less bandwidth, more latency)"
    else:
        reason += " (the placement group is the node group's, not in this file)"
    return gbps, True, reason


def _mismatch(declared: dict[str, Any], gbps: float, efa: bool) -> str:
    said_gbps, said_efa = _number(declared.get("gbps_per_node")), declared.get("efa")
    wrong = []
    if said_gbps is not None and said_gbps != gbps:
        wrong.append(f"{said_gbps:,.0f} Gb/s")
    if said_efa is not None and bool(said_efa) != efa:
        wrong.append("EFA" if said_efa else "no EFA")
    if not wrong:
        return ""
    return f"metadata.network declares {' with '.join(wrong)}, which is not what this node type delivers"
