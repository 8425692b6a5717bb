"""Enumeration: every valid plan, nothing else, and the vectorised filter agrees with `plan_problem`."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from service.catalog import load_model
from service.plans.enumerate import (
    INVALID_REASONS,
    VALID,
    candidate_table,
    count_codes,
    enumerate_plans,
    factorisations,
    micro_batches,
    problem_codes,
    reason_code,
    zero_variants,
)
from service.spec import ClusterSpec, ModelSpec, Plan, Workload, check_plan, plan_problem
from service.spec.engine import engine_rules
from service.spec.moe_spec import MoESpec
from service.spec.plan_table import ENGINE_CODES, PRECISION_CODES, RECOMPUTE_CODES, PlanTable, concat

TINY = ModelSpec(
    name="tiny", num_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
    ffn_hidden_size=344, vocab_size=512,
)  # fmt: skip
# Four capacity-routed experts 6 wide: ep 3 and expert_tp 4 do not divide them, and fsdp (dropless only)
# refuses the router.
TINY_MOE = TINY.model_copy(
    update={"moe": MoESpec(num_experts=4, experts_per_token=2, expert_ffn_hidden_size=6, router="capacity",
                           capacity_factor=1.25)}
)  # fmt: skip
ODD = ModelSpec(  # 6 heads, 3 KV heads, 3 layers: most tp and pp degrees fail on the model
    name="odd", num_layers=3, hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
    ffn_hidden_size=256, vocab_size=100,
)  # fmt: skip


def unchecked_plan(table: PlanTable, i: int) -> Plan:
    """Row i as a Plan without running its validator, so invalid candidates reach plan_problem."""
    values = {name: getattr(table, name)[i].item() for name in Plan.model_fields}
    values["recompute"] = RECOMPUTE_CODES[values["recompute"]]
    values["precision"] = PRECISION_CODES[values["precision"]]
    values["engine"] = ENGINE_CODES[values["engine"]]
    return Plan.model_construct(**values)


def test_factorisations_are_all_ordered_quadruples():
    for n in (1, 6, 12, 32):
        brute = {
            (a, b, c, d)
            for a in range(1, n + 1)
            for b in range(1, n + 1)
            for c in range(1, n + 1)
            for d in range(1, n + 1)
            if a * b * c * d == n
        }
        assert set(factorisations(n, max_cp=n)) == brute
        assert len(factorisations(n, max_cp=n)) == len(brute)
        assert set(factorisations(n)) == {f for f in brute if f[3] == 1}
    assert len(factorisations(32)) == 21  # C(5 + 2, 2) ordered factorisations of 2^5 into 3
    assert len(factorisations(32, max_cp=32)) == 56  # C(5 + 3, 3) into 4
    assert len(factorisations(32, max_cp=4)) == 21 + 15 + 10  # cp 1, 2, 4


def test_micro_batches_are_powers_of_two_up_to_the_cap():
    assert micro_batches(64) == [1, 2, 4, 8, 16, 32, 64]
    assert micro_batches(48) == [1, 2, 4, 8, 16, 32]
    assert micro_batches(1) == [1]
    assert micro_batches(0) == []


CASES = [
    (TINY, ClusterSpec(gpu="cpu", num_nodes=1, gpus_per_node=2), 8),
    (TINY, ClusterSpec(gpu="h100-sxm-80gb", num_nodes=2, gpus_per_node=8), 48),
    (ODD, ClusterSpec(gpu="h100-sxm-80gb", num_nodes=2, gpus_per_node=6), 36),
    (ODD, ClusterSpec(gpu="h100-sxm-80gb", num_nodes=3, gpus_per_node=4), 24),
    (load_model("llama2-13b"), ClusterSpec(gpu="h100-sxm-80gb", num_nodes=1, gpus_per_node=8), 64),
    (load_model("llama3-8b"), ClusterSpec(gpu="h100-sxm-80gb", num_nodes=2, gpus_per_node=8), 32),
]


@pytest.mark.parametrize(("model", "cluster", "batch"), CASES, ids=lambda x: getattr(x, "name", None))
def test_vectorised_filter_agrees_with_plan_problem_on_every_candidate(model, cluster, batch):
    workload = Workload(seq_len=128, global_batch_sequences=batch, tokens_to_train=1e6)
    table = candidate_table(cluster, workload, max_micro_batch=16, max_cp=4, engines=ENGINE_CODES)
    codes = problem_codes(table, model, cluster, workload)
    expected = np.array(
        [
            reason_code(plan_problem(unchecked_plan(table, i), model, cluster, workload))
            for i in range(len(table))
        ]
    )
    assert np.array_equal(codes, expected)
    assert (codes == VALID).sum() > 0  # each case has valid plans, and invalid ones for several reasons
    assert len(set(codes.tolist())) >= 6


def _zero3_grid() -> PlanTable:
    """ZeRO-3 rows over dp, cp, hpZ and shard-group sizes, where their size rules bite: DeepSpeed's with
    hpZ, FSDP's with shard groups (HSDP)."""
    dp, cp, hpz, group = (
        g.ravel() for g in np.meshgrid([1, 2, 3, 6], [1, 2, 3], [1, 2, 4], [0, 0, 2, 3], indexing="ij")
    )
    ones = np.ones(len(dp), dtype=np.int64)
    engine = np.where(group > 0, ENGINE_CODES.index("fsdp"), ENGINE_CODES.index("deepspeed"))
    return PlanTable.from_columns(
        dp=dp, tp=ones, pp=ones, cp=cp, zero_stage=ones * 3, offload_optimizer=ones == 0,
        offload_params=ones == 0, micro_batch=ones, grad_accum=12 // dp, recompute=ones * 0,
        sequence_parallel=ones == 0, precision=ones * 0, zero_hpz_partition_size=hpz, shard_group_size=group,
        engine=engine,
    )  # fmt: skip


def test_vectorised_filter_agrees_on_random_tables_without_cluster_or_workload():
    """Random shapes hit the rules enumeration never produces (dp·tp·pp·cp off the GPU count, tp > node)."""
    rng = np.random.default_rng(0)
    n = 8000
    table = PlanTable.from_columns(
        dp=rng.integers(1, 9, n), tp=rng.choice([1, 2, 3, 4, 8, 16], n), pp=rng.choice([1, 2, 3, 4, 8], n),
        zero_stage=rng.integers(0, 4, n), offload_optimizer=rng.random(n) < 0.3,
        offload_params=rng.random(n) < 0.3,
        micro_batch=rng.integers(1, 5, n), grad_accum=rng.integers(1, 5, n), recompute=rng.integers(0, 3, n),
        sequence_parallel=rng.random(n) < 0.3, precision=rng.integers(0, 4, n),
        cp=rng.choice([1, 2, 3, 4], n), engine=rng.integers(0, 3, n),
        virtual_stages=rng.choice([1, 1, 2, 3], n), zero_hpz_partition_size=rng.choice([1, 1, 1, 2, 4], n),
        shard_group_size=rng.choice([0, 0, 0, 2, 3], n), zero_quantized_weights=rng.random(n) < 0.1,
        zero_quantized_gradients=rng.random(n) < 0.1, comm_overlap=rng.random(n) < 0.2,
        tp_comm_overlap=rng.random(n) < 0.2, ep=rng.choice([1, 1, 2, 3, 4], n),
        expert_tp=rng.choice([1, 1, 2, 4], n),
        ep_comm_overlap=rng.random(n) < 0.2,
    )  # fmt: skip
    grid = _zero3_grid()
    fp8 = dataclasses.replace(grid, precision=np.full(len(grid), PRECISION_CODES.index("fp8")))
    # megatron's interleaved 1F1B with one micro-batch of a 12-sequence batch over dp 3: fewer than pp 2
    interleaved = PlanTable.from_columns(
        dp=np.array([3]), tp=np.array([1]), pp=np.array([2]), zero_stage=np.array([1]),
        offload_optimizer=np.array([False]), offload_params=np.array([False]), micro_batch=np.array([4]),
        grad_accum=np.array([1]), recompute=np.array([0]), sequence_parallel=np.array([False]),
        precision=np.array([0]), engine=np.array([2]), virtual_stages=np.array([2]),
    )  # fmt: skip
    table = concat([table, grid, fp8, interleaved])
    n = len(table)
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=2, gpus_per_node=3)  # tp 2 divides 6, not 3
    workload = Workload(seq_len=130, global_batch_sequences=12, tokens_to_train=1e6)  # cp 4 does not split it
    seen: set[int] = set()
    a100 = ClusterSpec(gpu="a100-sxm-80gb", num_nodes=2, gpus_per_node=3)  # no FP8 tensor cores
    cases = [(None, None), (cluster, None), (cluster, workload), (None, workload), (a100, workload)]
    for (c, w), model in itertools.product(cases, (TINY, TINY_MOE)):
        codes = problem_codes(table, model, c, w)
        plans = [unchecked_plan(table, i) for i in range(n)]
        expected = np.array([reason_code(plan_problem(p, model, c, w)) for p in plans])
        assert np.array_equal(codes, expected)
        seen |= set(codes.tolist())
    # Every rule was exercised somewhere, but one no engine's table triggers today.
    unused = {name for name in ("MoE blocks with pp on an engine without it",)}
    if any(not engine_rules(e).expert_parallel.with_pipeline for e in ENGINE_CODES):
        unused = set()
    assert seen == {i for i, (name, _, _) in enumerate(INVALID_REASONS) if name not in unused}


def test_two_stage_enumeration_equals_filtering_the_full_cross_product():
    model, cluster = load_model("llama2-13b"), ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4, gpus_per_node=8)
    workload = Workload(seq_len=4096, global_batch_sequences=128, tokens_to_train=2e9)
    table = candidate_table(cluster, workload)
    codes = problem_codes(table, model, cluster, workload)
    result = enumerate_plans(model, cluster, workload)
    # 55 (dp, tp, pp, cp) with cp ≤ 16; ZeRO 0-3 and ZeRO-3 with hpZ (quantized collectives are opt-in;
    # shard groups are FSDP's, not tried on deepspeed rows)
    assert result.candidates == len(table) == 55 * 5 * 2 * 2 * 7 * 3 * 2
    assert result.invalid_counts == count_codes(codes)
    assert sum(result.invalid_counts.values()) + len(result.plans) == result.candidates
    key = lambda t: sorted(zip(*(getattr(t, f).tolist() for f in Plan.model_fields), strict=True))  # noqa: E731
    assert key(result.plans) == key(table.take(codes == VALID))
    assert len(result.plans) == 2730
    # Asked for, ZeRO++'s quantized collectives add two ZeRO-3 variants (hpZ + qwZ + qgZ, qwZ + qgZ).
    quantized = enumerate_plans(model, cluster, workload, quantized_collectives=True)
    assert quantized.candidates == 55 * 7 * 2 * 2 * 7 * 3 * 2
    qz = quantized.plans.zero_quantized_weights & quantized.plans.zero_quantized_gradients
    assert len(quantized.plans) - len(result.plans) == int(qz.sum()) == 432  # test_valid_plan_counts.py


def test_every_enumerated_plan_is_a_valid_plan_for_the_workload():
    model, cluster = load_model("llama2-13b"), ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4, gpus_per_node=8)
    workload = Workload(seq_len=4096, global_batch_sequences=128, tokens_to_train=2e9)
    plans = enumerate_plans(model, cluster, workload).plans
    for i in range(len(plans)):
        plan = check_plan(plans.row(i), model, cluster, workload)  # raises on any invalid plan
        assert plan.micro_batch * plan.grad_accum * plan.dp == 128
    labels = {plans.row(i).short() for i in range(len(plans))}
    assert "dp4-tp8-pp1-z1-mb1-ga32-rc:sele-sp" in labels
    assert "dp32-tp1-pp1-z3-offopt-offpar-mb4-ga1-rc:full" in labels
    assert "dp8-tp1-pp4-z1-mb16-ga1-rc:none" in labels
    assert "dp2-tp8-pp2-z1-mb1-ga64-rc:none" in labels  # TP inside the pipeline (Megatron-DeepSpeed)
    assert not any("tp16" in label or ("pp2-z2" in label) for label in labels)  # no TP across nodes


def test_enumeration_is_complete_against_brute_force():
    """Every Plan plan_problem accepts (micro-batch a power of two ≤ cap) is enumerated, and only those."""
    cluster = ClusterSpec(gpu="cpu", num_nodes=2, gpus_per_node=2)  # two nodes: ZeRO++, shard groups tried
    workload = Workload(seq_len=64, global_batch_sequences=8, tokens_to_train=1e6)
    brute = set()
    shapes = [
        (d, t, p, c)
        for d in range(1, 5)
        for t in range(1, 5)
        for p in range(1, 5)
        for c in range(1, 5)
        if d * t * p * c == 4
    ]
    assert zero_variants(8, 8) == []  # one node: hpZ / shard groups are the whole ZeRO group
    zeros = [(z, 1, 0, False, False) for z in range(4)] + [(3, *v) for v in zero_variants(2, 4)]
    for (dp, tp, pp, cp), (zero, hpz, mics, qw, qg), oo, op, mb, ga, rc, sp in itertools.product(
        shapes,
        zeros,
        (False, True),
        (False, True),
        (1, 2, 4, 8),
        range(1, 9),
        RECOMPUTE_CODES,
        (False, True),
    ):
        plan = Plan.model_construct(
            dp=dp, tp=tp, pp=pp, cp=cp, zero_stage=zero, offload_optimizer=oo, offload_params=op,
            micro_batch=mb, grad_accum=ga, recompute=rc, sequence_parallel=sp, precision="bf16",
            zero_hpz_partition_size=hpz, shard_group_size=mics, zero_quantized_weights=qw,
            zero_quantized_gradients=qg,
        )  # fmt: skip
        if plan_problem(plan, TINY, cluster, workload) is None:
            brute.add(plan.short())
    plans = enumerate_plans(TINY, cluster, workload, max_micro_batch=8).plans
    enumerated = [plans.row(i).short() for i in range(len(plans))]
    assert len(enumerated) == len(set(enumerated))
    assert set(enumerated) == brute
    assert len(brute) > 50


def test_precision_and_micro_batch_cap_are_applied():
    model, cluster = TINY, ClusterSpec(gpu="cpu", num_nodes=1, gpus_per_node=2)
    workload = Workload(seq_len=64, global_batch_sequences=64, tokens_to_train=1e6)
    plans = enumerate_plans(model, cluster, workload, max_micro_batch=4, precision="fp32").plans
    assert set(plans.micro_batch.tolist()) == {1, 2, 4}
    assert set(plans.precision.tolist()) == {PRECISION_CODES.index("fp32")}
    assert plans.row(0).precision == "fp32"


def test_every_engine_is_enumerated_under_its_own_rules():
    model, cluster = load_model("llama2-13b"), ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4, gpus_per_node=8)
    workload = Workload(seq_len=4096, global_batch_sequences=128, tokens_to_train=2e9)
    table = candidate_table(cluster, workload, engines=ENGINE_CODES)
    codes = problem_codes(table, model, cluster, workload)
    result = enumerate_plans(model, cluster, workload, engines=ENGINE_CODES)
    assert result.invalid_counts == count_codes(codes)
    assert len(result.plans) == (codes == VALID).sum()
    plans = result.plans
    by_engine = {e: int((plans.engine == i).sum()) for i, e in enumerate(ENGINE_CODES)}
    assert by_engine["deepspeed"] == 2730  # the deepspeed-only count (test_valid_plan_counts.py)
    fsdp, megatron = plans.take(plans.engine == 1), plans.take(plans.engine == 2)
    # FSDP: no ZeRO-1, offload all or nothing, pipelines as torchtitan runs them; Megatron: ZeRO ≤ 1
    # with a pipeline, Megatron-FSDP (ZeRO 2-3) without one.
    # pp 16 and 32 split the 40 layers unevenly (3/2 and 2/1 blocks per stage).
    assert set(fsdp.zero_stage.tolist()) == {0, 2, 3} and set(fsdp.pp.tolist()) == {1, 2, 4, 8, 16, 32}
    assert (fsdp.offload_optimizer == fsdp.offload_params).all()
    assert set(megatron.zero_stage.tolist()) == {0, 1, 2, 3} and not megatron.offload_optimizer.any()
    assert (megatron.pp[megatron.zero_stage >= 2] == 1).all()
    # Shard groups (HSDP) of 1 and 2 nodes (8, 16 ranks; 4 nodes is the whole cluster) on FSDP's ZeRO-3
    # rows only; ZeRO++ on DeepSpeed's only.
    hsdp = fsdp.take(fsdp.shard_group_size > 0)
    assert len(hsdp) and set(hsdp.shard_group_size.tolist()) == {8, 16} and (hsdp.zero_stage == 3).all()
    assert not (plans.take(plans.engine != 1).shard_group_size > 0).any()
    assert not (plans.take(plans.engine != 0).zero_hpz_partition_size > 1).any()
    # Interleaving on megatron and fsdp (torchtitan), every chunk holding at least one of the 40 layers.
    for interleaving in (megatron, fsdp):
        assert set(interleaving.virtual_stages.tolist()) == {1, 2, 3, 4, 5}
        assert (interleaving.pp * interleaving.virtual_stages <= 40).all()
    assert set(plans.take(plans.engine == 0).virtual_stages.tolist()) == {1}
    # Ring attention (megatron, fsdp) needs no whole heads per rank: cp 16 with tp 2 on 40 heads.
    assert ((megatron.cp == 16) & (megatron.tp == 2)).any()
    assert not ((plans.engine == 0) & (plans.cp == 16) & (plans.tp == 2)).any()


def test_several_precisions_are_enumerated_together():
    cluster = ClusterSpec(gpu="cpu", num_nodes=1, gpus_per_node=2)
    workload = Workload(seq_len=64, global_batch_sequences=8, tokens_to_train=1e6)
    one = enumerate_plans(TINY, cluster, workload, max_micro_batch=4)
    two = enumerate_plans(TINY, cluster, workload, max_micro_batch=4, precision=("bf16", "fp32"))
    assert len(two.plans) == 2 * len(one.plans) and two.candidates == 2 * one.candidates
    assert set(two.plans.precision.tolist()) == {PRECISION_CODES.index("bf16"), PRECISION_CODES.index("fp32")}


def test_outside_space_names_the_choice_the_enumeration_does_not_try():
    from service.plans.space import outside_space

    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4)
    assert outside_space(Plan(dp=32, zero_stage=3), cluster) is None
    assert "engines deepspeed" in outside_space(Plan(dp=32, zero_stage=3, engine="fsdp"), cluster)
    assert "micro_batch in" in outside_space(Plan(dp=32, micro_batch=3), cluster)
    assert "cp up to 16" in outside_space(Plan(dp=1, cp=32), cluster)
    assert "virtual_stages in" in outside_space(
        Plan(dp=4, pp=8, virtual_stages=6, engine="megatron"), cluster, ["megatron"]
    )
    assert "zero_variants" in outside_space(Plan(dp=32, zero_stage=3, zero_hpz_partition_size=4), cluster)
    assert outside_space(Plan(dp=32, zero_stage=3, zero_hpz_partition_size=8), cluster) is None
    assert "bf16 plans only" in outside_space(Plan(dp=32, precision="fp8"), cluster)
    quantized = Plan(dp=32, zero_stage=3, zero_hpz_partition_size=8, zero_quantized_weights=True,
                     zero_quantized_gradients=True)  # fmt: skip
    assert "quantized_collectives: true" in outside_space(quantized, cluster)
    assert outside_space(quantized, cluster, quantized_collectives=True) is None
    megatron = Plan(dp=4, tp=8, zero_stage=1, sequence_parallel=True, engine="megatron")
    assert "every overlap its rules allow" in outside_space(megatron, cluster, ["megatron"])
    on = megatron.model_copy(update={"comm_overlap": True, "tp_comm_overlap": True})
    assert outside_space(on, cluster, ["megatron"]) is None
