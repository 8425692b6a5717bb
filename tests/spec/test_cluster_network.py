"""A cluster's own network: `inter_node_bandwidth_gb_per_s` replaces the catalog's NIC rate per GPU, and
the cost model and the memo use it."""

from __future__ import annotations

from service.catalog import load_model
from service.costmodel import estimate
from service.design.sensitivity import levers, with_network
from service.report.memo import _network
from service.report.result import ClusterSummary
from service.spec import ClusterSpec, Plan, Workload
from service.spec.params import ModelParams
from service.spec.workload import Budget

WORKLOAD = Workload(seq_len=4096, global_batch_sequences=128, tokens_to_train=2e9)


def test_the_override_reaches_the_gpu_spec_and_survives_a_round_trip():
    catalog = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4)
    cloud = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4, inter_node_bandwidth_gb_per_s=12.5)
    assert catalog.gpu.inter_node_bandwidth_gb_per_s == 50.0  # one 400 Gb/s NIC per H100
    assert cloud.gpu.inter_node_bandwidth_gb_per_s == 12.5
    assert ClusterSpec.model_validate(cloud.model_dump()) == cloud
    assert cloud.gpu.intra_node_bandwidth_gb_per_s == catalog.gpu.intra_node_bandwidth_gb_per_s


def test_a_slower_network_slows_plans_that_cross_it_and_no_others():
    model = load_model("llama2-13b")
    zero3 = Plan(dp=32, zero_stage=3, micro_batch=1, grad_accum=4)
    fast = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4)
    slow = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4, inter_node_bandwidth_gb_per_s=6.25)
    a, b = estimate(model, fast, zero3, WORKLOAD), estimate(model, slow, zero3, WORKLOAD)
    # 13 B parameters gathered twice and reduce-scattered per micro-batch over 400 Gb/s per node.
    assert b.time_breakdown_s.dp_comm > 2 * a.time_breakdown_s.dp_comm
    assert b.tokens_per_s < 0.95 * a.tokens_per_s
    one_node = Plan(dp=8, zero_stage=3, micro_batch=1, grad_accum=16)
    node_fast = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=1)
    node_slow = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=1, inter_node_bandwidth_gb_per_s=6.25)
    assert (
        estimate(model, node_slow, one_node, WORKLOAD).tokens_per_s
        == estimate(model, node_fast, one_node, WORKLOAD).tokens_per_s
    )


def test_the_memo_states_the_network_it_assumed_when_nodes_are_crossed():
    info = ClusterSummary(
        gpu="h100-sxm-80gb", num_nodes=4, gpus_per_node=8, num_gpus=32, price_per_gpu_hour_usd=2.5,
        hbm_gib=80, inter_node_bandwidth_gb_per_s=12.5,
    )  # fmt: skip
    assert _network(info) == "; between nodes 800 Gb/s per node, 12.5 GB/s per GPU"
    assert _network(info.model_copy(update={"num_nodes": 1})) == ""
    unstated = info.model_copy(update={"inter_node_bandwidth_gb_per_s": None})
    assert _network(unstated) == ""  # results written before the field


def test_the_bandwidth_scenario_moves_a_clusters_own_network_and_survives_revalidation():
    cloud = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4, inter_node_bandwidth_gb_per_s=12.5)
    low = with_network(cloud, 6.25)
    assert low.gpu.inter_node_bandwidth_gb_per_s == 6.25
    assert ClusterSpec.model_validate(low.model_dump()).gpu.inter_node_bandwidth_gb_per_s == 6.25
    scenarios = {lv.name: lv.cluster for lv in levers(cloud, ModelParams(), Budget())}
    # The cloud's own 12.5 GB/s is the nominal case, not a scenario; the other two network levels are.
    nets = sorted(c.gpu.inter_node_bandwidth_gb_per_s for n, c in scenarios.items() if "network" in n)
    assert nets == [25.0, 50.0]
    assert scenarios["memory +15%"].gpu.inter_node_bandwidth_gb_per_s == 12.5
