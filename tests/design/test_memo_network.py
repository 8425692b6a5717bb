"""The memo prices inter-node traffic at the GPU catalog's rate (3,200 Gb/s per 8×H100 node); it says
what the shipped cluster file delivers, counted from its EFA interfaces, and names it a risk when the file
delivers less (a node type without EFA: NCCL over TCP on one 100 Gb/s card)."""

from __future__ import annotations

from pathlib import Path

import yaml

from service.design.finish import cluster_network
from service.spec import load_experiment

REPO = Path(__file__).resolve().parents[2]
SEED = load_experiment(REPO / "experiments" / "llama2-13b-32xh100.yaml")


def test_the_shipped_cluster_file_delivers_what_the_seed_is_priced_at():
    row, risk = cluster_network(SEED)
    assert risk is None
    assert row.what == "inter-node network 3,200 Gb/s per node"
    assert "ray_cluster.yaml delivers 3,200 Gb/s per node: gpu-8xh100 (p5.48xlarge): 32 EFA" in row.source


def test_a_cluster_file_without_efa_is_a_risk_with_the_bandwidth_to_replan_at(tmp_path):
    data = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())
    for node_type in data["available_node_types"].values():
        node_type["node_config"].pop("NetworkInterfaces", None)
    path = tmp_path / "ray_cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    row, risk = cluster_network(SEED, path)
    assert "ray_cluster.yaml delivers 100 Gb/s per node" in row.source
    assert risk is not None and risk.startswith(
        "network: ray_cluster.yaml delivers 100 Gb/s per node, below the 3,200 Gb/s the plan is priced at"
    )
    assert risk.endswith("cluster.inter_node_bandwidth_gb_per_s: 1.5625")  # 100 Gb/s ÷ 8 bits ÷ 8 GPUs


def test_one_node_needs_no_network():
    one_node = SEED.model_copy(update={"cluster": SEED.cluster.model_copy(update={"num_nodes": 1})})
    row, risk = cluster_network(one_node)
    assert risk is None and row.source == "GPU catalog, experiment"
