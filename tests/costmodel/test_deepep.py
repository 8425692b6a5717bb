"""DeepEP's token exchange (Workload.moe_dispatcher deepep, costmodel/expert_exchange.py): a token crosses the
network once per remote node its experts are on, capped by group-limited routing; checked against
hand-computed node counts and bytes."""

from __future__ import annotations

import numpy as np
import pytest

from service.catalog import load_model
from service.costmodel import expert_exchange, moe
from service.costmodel.estimate import estimate
from service.costmodel.step_time import effective_gpu, links
from service.spec import ClusterSpec, Plan, Workload
from service.spec.params import load_params
from service.spec.plan_table import PlanTable
from tests.costmodel.conftest import seed_experiment_with

V3, QWEN = load_model("deepseek-v3"), load_model("qwen3-235b-a22b")


def test_a_token_reaches_the_nodes_its_routes_fall_on_at_most_its_groups_worth():
    # Qwen3-235B routes 8 of 128 experts with no groups: over 4 nodes, 4·(1 − (3/4)^8) of them.
    assert expert_exchange.nodes_per_token(QWEN, 4) == pytest.approx(4 * (1 - 0.75**8))
    assert expert_exchange.nodes_per_token(QWEN, 1) == pytest.approx(1.0)
    # DeepSeek-V3: 4 of 8 groups of 32 experts. On 8 nodes, one group each: at most 4 (§2.1.2); on 16,
    # each group spans 2 nodes: at most 8; on 4 nodes every node can be reached.
    assert expert_exchange.nodes_per_token(V3, 8) == 4.0
    assert expert_exchange.nodes_per_token(V3, 16) == pytest.approx(16 * (1 - (15 / 16) ** 8))  # 6.4 < 8
    assert expert_exchange.nodes_per_token(V3, 4) == pytest.approx(4 * (1 - 0.75**8))


def _one_pass(model, cluster, plan, dispatcher):
    params = load_params()
    p = PlanTable.from_plans([plan])
    d = np.asarray(2.0)
    gpu, net = effective_gpu(cluster.gpu, params), links(params)
    t = expert_exchange.dispatch_combine_time_s(
        model, p, 4096, d, cluster.gpus_per_node, gpu, net, 1.0, params["all_to_all_efficiency"], dispatcher
    )
    return float(t[0]), gpu, net, params


def test_across_eight_nodes_deepep_sends_three_and_a_half_copies_where_nccl_sends_seven():
    """EP 64 over 8 H100 nodes, bf16, one 4,096-token micro-batch: NCCL's all-to-all sends the 8 routed
    copies, 7/8 of them off the node; DeepEP each token once to each of its 4 nodes but its own, 3.5
    on average. Both are bound by the NIC."""
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=8)
    plan = Plan(dp=64, ep=64, engine="megatron", zero_stage=1)
    nccl, gpu, net, params = _one_pass(V3, cluster, plan, "alltoall")
    deepep, *_ = _one_pass(V3, cluster, plan, "deepep")
    nic = gpu.inter_node_bandwidth_gb_per_s * 1e9 * params["all_to_all_efficiency"]
    p = PlanTable.from_plans([plan])
    latency = float(comm_latency(p, cluster, gpu, net))
    bytes_per_copy = 4096 * V3.hidden_size * 2
    assert deepep == pytest.approx(2 * (3.5 * bytes_per_copy / nic + latency))  # dispatch and combine
    assert nccl == pytest.approx(2 * (7 * bytes_per_copy / nic + latency))
    assert _one_pass(V3, cluster, plan, "hybridep")[0] == pytest.approx(deepep)  # the same scheme


def comm_latency(p, cluster, gpu, net):
    from service.costmodel import comm

    return comm.ring_latency_s(p.ep, moe.ep_stride(p), cluster.gpus_per_node, gpu, 1, net)[0]


def test_inside_one_node_and_for_other_engines_the_exchange_is_unchanged():
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=1)
    plan = Plan(dp=8, ep=8, engine="megatron", zero_stage=1)
    assert _one_pass(QWEN, cluster, plan, "deepep")[0] == pytest.approx(
        _one_pass(QWEN, cluster, plan, "alltoall")[0]
    )
    work = Workload(seq_len=4096, global_batch_sequences=256, tokens_to_train=1e12)
    four_nodes = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4)
    fsdp = Plan(dp=32, ep=32, engine="fsdp", zero_stage=3, grad_accum=8)
    deepep = work.model_copy(update={"moe_dispatcher": "deepep"})
    assert (
        estimate(QWEN, four_nodes, fsdp, deepep).step_time_s
        == estimate(QWEN, four_nodes, fsdp, work).step_time_s
    )
    megatron = Plan(dp=32, ep=32, engine="megatron", zero_stage=1, grad_accum=8)
    faster = estimate(QWEN, four_nodes, megatron, deepep).time_breakdown_s.ep_comm
    assert faster < 0.5 * estimate(QWEN, four_nodes, megatron, work).time_breakdown_s.ep_comm


def test_deepep_is_megatrons_and_groups_divide_the_experts(tmp_path, capsys):
    from service.cli.main import main
    from service.spec import SpecError, load_experiment
    from service.spec.errors import validate_as
    from service.spec.moe_spec import MoESpec

    with pytest.raises(SpecError) as info:
        validate_as(
            MoESpec, dict(num_experts=256, experts_per_token=8, expert_ffn_hidden_size=2048, expert_groups=7)
        )
    assert info.value.field == "expert_groups" and "a divisor of 256" in info.value.message
    with pytest.raises(SpecError) as info:
        load_experiment(seed_experiment_with(tmp_path, moe_dispatcher="deepep"))
    assert info.value.field == "workload.moe_dispatcher" and "add megatron to engines" in info.value.message
    flags = ["estimate", "--model", "qwen3-235b-a22b", "--gpu", "h100-sxm-80gb", "--gpus", "32", "--ep", "32"]
    flags += ["--zero", "1", "--grad-accum", "8", "--moe-dispatcher", "deepep"]
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--moe-dispatcher" in err and "engine megatron" in err
    assert main([*flags, "--engine", "megatron", "--json"]) == 0
