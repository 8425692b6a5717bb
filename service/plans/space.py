"""What the enumeration tries, for a plan it did not: which of its choices lies outside the space."""

from __future__ import annotations

from collections.abc import Sequence

from service.plans.enumerate import (
    DEFAULT_MAX_CP,
    DEFAULT_MAX_MICRO_BATCH,
    DEFAULT_VIRTUAL_STAGES,
    ep_overlap_allowed,
    micro_batches,
    precisions_of,
    zero_variants,
)
from service.spec.engine import engine_rules
from service.spec.hardware import ClusterSpec
from service.spec.plan import Engine, Plan, Precision
from service.spec.plan_table import PlanTable


def outside_space(
    plan: Plan,
    cluster: ClusterSpec,
    engines: Sequence[Engine] = ("deepspeed",),
    max_micro_batch: int = DEFAULT_MAX_MICRO_BATCH,
    precision: Precision | Sequence[Precision] = "bf16",
    quantized_collectives: bool = False,
) -> str | None:
    """Which choice of a valid `plan` the enumeration does not try (None when it is a candidate)."""
    if plan.engine not in engines:
        return f"the planner searched engines {', '.join(engines)} (the experiment's `engines`)"
    if plan.micro_batch not in micro_batches(max_micro_batch):
        return f"the planner tries micro_batch in {micro_batches(max_micro_batch)}"
    if plan.cp > DEFAULT_MAX_CP:
        return f"the planner tries cp up to {DEFAULT_MAX_CP}"
    if plan.virtual_stages not in DEFAULT_VIRTUAL_STAGES:
        return f"the planner tries virtual_stages in {list(DEFAULT_VIRTUAL_STAGES)}"
    hpz, group = plan.zero_hpz_partition_size, plan.shard_group_size
    zero = (hpz, group, plan.zero_quantized_weights, plan.zero_quantized_gradients)
    variants = zero_variants(cluster.gpus_per_node, cluster.num_gpus, quantized_collectives)
    if (plan.zero_quantized_weights or plan.zero_quantized_gradients) and not quantized_collectives:
        return "the planner tries ZeRO++'s quantized collectives only with `quantized_collectives: true`"
    if zero != (1, 0, False, False) and zero not in variants:
        return "the planner tries ZeRO++ and shard groups only as `zero_variants` lists them (multi-node)"
    rules = engine_rules(plan.engine)
    if rules.comm_overlap != plan.comm_overlap or plan.tp_comm_overlap != (
        rules.tp_comm_overlap and plan.sequence_parallel
    ):
        return (
            f"the planner tries {plan.engine} plans with every overlap its rules allow turned on "
            "(comm_overlap; tp_comm_overlap with sequence_parallel)"
        )
    table = PlanTable.from_plans([plan])
    if plan.ep_comm_overlap != bool(ep_overlap_allowed(table)[0] and plan.ep > 1):
        return "the planner turns the all-to-all overlap on wherever the engine allows it (ep > 1)"
    if plan.expert_tp not in (1, plan.tp):
        return "the planner tries expert_tp 1 and expert_tp = tp"
    if plan.precision not in precisions_of(precision):
        return f"the planner scored {', '.join(precisions_of(precision))} plans only"
    return None
