"""service/cluster/network.py: the inter-node bandwidth a cluster file can deliver, counted from its EFA
interfaces (Ray autoscaler file) or EFA device requests (KubeRay), and the shipped files deliver the
3,200 Gb/s per p5.48xlarge node that the cost model assumes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from manifest_checks import ROOT

from service.cluster.network import declared_network
from service.spec.errors import SpecError

SHIPPED = yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())
DECLARED = {"node_type": "big", "efa": True, "gbps_per_node": 3200}  # a metadata.network


def _interfaces(n: int, kind: str = "efa") -> list[dict[str, Any]]:
    where = {"SubnetId": "subnet-1", "Groups": ["sg-1"]}
    return [
        {"NetworkCardIndex": i, "DeviceIndex": min(i, 1), "InterfaceType": kind, **where} for i in range(n)
    ]


def _ray_file(tmp_path: Path, node_config: dict[str, Any], network: dict[str, Any] | None = None) -> Path:
    config: dict[str, Any] = {
        "cluster_name": "c",
        "provider": {"type": "aws", "region": "us-east-1"},
        "head_node_type": "head",
        "available_node_types": {
            "head": {"resources": {"CPU": 0}, "node_config": {"InstanceType": "m6i.4xlarge"}},
            "small": {"resources": {"GPU": 1}, "node_config": {"InstanceType": "p5.4xlarge"}},
            "big": {"resources": {"GPU": 8}, "node_config": {"InstanceType": "p5.48xlarge", **node_config}},
        },
    }
    if network is not None:
        config["metadata"] = {"network": network}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_32_efa_interfaces_in_a_placement_group(tmp_path: Path):
    path = _ray_file(tmp_path, {"NetworkInterfaces": _interfaces(32), "Placement": {"GroupName": "pg"}})
    gbps, efa, reason = declared_network(path)
    assert (gbps, efa) == (3200.0, True)  # the node type with the most GPUs, "big"
    assert (
        reason
        == "big (p5.48xlarge): 32 EFA interfaces × 100 Gb/s = 3,200 Gb/s per node, in placement group pg"
    )


def test_efa_only_interfaces_count_and_a_card_counts_once(tmp_path: Path):
    interfaces = _interfaces(32, "efa-only")
    interfaces[0]["InterfaceType"] = "efa"
    interfaces.append({**interfaces[5], "DeviceIndex": 0})  # a second interface on card 5
    gbps, efa, _ = declared_network(_ray_file(tmp_path, {"NetworkInterfaces": interfaces}))
    assert (gbps, efa) == (3200.0, True)


def test_one_efa_interface_carries_one_card(tmp_path: Path):
    gbps, efa, reason = declared_network(_ray_file(tmp_path, {"NetworkInterfaces": _interfaces(1)}))
    assert (gbps, efa) == (100.0, True)
    assert "1 EFA interfaces × 100 Gb/s = 100 Gb/s per node (32 network cards; 3,200 Gb/s" in reason
    assert "in no cluster placement group" in reason


def test_without_efa_it_falls_back_to_the_ena_tcp_rate(tmp_path: Path):
    path = _ray_file(tmp_path, {"SubnetIds": ["subnet-1"]}, DECLARED)
    gbps, efa, reason = declared_network(path)
    assert (gbps, efa) == (100.0, False)
    assert "no EFA interfaces, so NCCL falls back to TCP sockets on the primary ENA interface" in reason
    assert "at most 100 Gb/s per node (single TCP flows 5 Gb/s), not the 3,200 Gb/s of 32 EFA" in reason
    # The declaration the node type cannot deliver is said.
    assert reason.endswith(
        "metadata.network declares 3,200 Gb/s with EFA, which is not what this node type delivers"
    )


def test_a_matching_declaration_adds_nothing(tmp_path: Path):
    node_config = {"NetworkInterfaces": _interfaces(32), "Placement": {"GroupName": "pg"}}
    path = _ray_file(tmp_path, node_config, DECLARED)
    assert "metadata.network" not in declared_network(path)[2]


def test_node_type_by_name_and_unknown_instance_types(tmp_path: Path):
    path = _ray_file(tmp_path, {"NetworkInterfaces": _interfaces(32)}, DECLARED)
    gbps, efa, reason = declared_network(path, "small")  # p5.4xlarge: no network cards documented here
    assert (gbps, efa) == (0.0, False)
    assert "network cards not documented here" in reason and "no bandwidth declared" in reason
    with pytest.raises(SpecError, match="no node type 'nope'"):
        declared_network(path, "nope")


def test_an_unknown_instance_type_takes_the_declaration(tmp_path: Path):
    path = _ray_file(tmp_path, {"InstanceType": "x9.metal"}, {**DECLARED, "gbps_per_node": 800})
    gbps, efa, reason = declared_network(path)
    assert (gbps, efa) == (800.0, True) and "800 Gb/s as metadata.network declares" in reason


def test_kuberay_counts_the_efa_device_request(tmp_path: Path):
    doc = yaml.safe_load_all((ROOT / "deploy/kuberay/rayjob.yaml").read_text())
    job = next(d for d in doc if d["kind"] == "RayJob")
    gbps, efa, reason = declared_network(ROOT / "deploy/kuberay/rayjob.yaml")
    assert (gbps, efa) == (3200.0, True) and reason.startswith("gpu-8xh100 (p5.48xlarge): 32 EFA interfaces")
    bare = copy.deepcopy(job)
    for group in bare["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        for part in group["template"]["spec"]["containers"][0]["resources"].values():
            part.pop("vpc.amazonaws.com/efa", None)
    path = tmp_path / "rayjob.yaml"
    path.write_text(yaml.safe_dump(bare))
    gbps, efa, reason = declared_network(path)
    assert (gbps, efa) == (100.0, False) and "10 in a cluster placement group" in reason


def test_unreadable_files_are_one_line_errors(tmp_path: Path):
    (tmp_path / "bad.yaml").write_text("a: [")
    with pytest.raises(SpecError, match="cannot read it as YAML"):
        declared_network(tmp_path / "bad.yaml")
    (tmp_path / "other.yaml").write_text("kind: Deployment\n")
    with pytest.raises(SpecError, match="neither a Ray cluster file"):
        declared_network(tmp_path / "other.yaml")


def test_the_shipped_cluster_file_declares_efa_with_a_placement_group():
    gbps, efa, reason = declared_network(ROOT / "ray_cluster.yaml")
    declared = SHIPPED["metadata"]["network"]
    assert (gbps, efa) == (declared["gbps_per_node"], declared["efa"]) == (3200, True)
    node_config = SHIPPED["available_node_types"][declared["node_type"]]["node_config"]
    assert node_config["Placement"]["GroupName"] == declared["placement_group"]
    assert reason.endswith(f"in placement group {declared['placement_group']}")  # and no mismatch said
