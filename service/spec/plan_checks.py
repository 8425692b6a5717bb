"""Whether a `Plan` can run a model on a cluster for a workload: `plan_problem`, the one place that
decides it (the enumerator's column rules, service/plans/rules.py, restate it on arrays), `check_plan`
(the same as a `SpecError` naming the field) and `allowed_values` (what a layout field could be instead)."""

from __future__ import annotations

from service.spec.engine import engine_rules
from service.spec.errors import SpecError
from service.spec.hardware import ClusterSpec
from service.spec.model import ModelSpec
from service.spec.plan import Plan, plan_only_problem
from service.spec.workload import Workload


def _moe_problem(plan: Plan, model: ModelSpec) -> tuple[str, str] | None:
    """Expert parallelism against the model's experts and the engine's MoE rule table.
    `service/plans/rules.py` restates them on columns, in this order."""
    moe = model.moe
    if moe is None:
        if plan.ep > 1:
            return "ep", f"ep {plan.ep}: the model has no routed experts (a dense model); allowed: 1"
        if plan.expert_tp > 1:
            return "expert_tp", f"expert_tp {plan.expert_tp}: the model has no routed experts; allowed: 1"
        return None
    if moe.num_experts % plan.ep:
        return "ep", f"ep {plan.ep} does not divide num_experts {moe.num_experts}"
    if moe.expert_ffn_hidden_size % plan.expert_tp:
        width = moe.expert_ffn_hidden_size
        return "expert_tp", f"expert_tp {plan.expert_tp} does not divide expert_ffn_hidden_size {width}"
    rule, name = engine_rules(plan.engine).expert_parallel, plan.engine
    if plan.zero_stage > rule.max_zero_stage:
        why = engine_rules(name).reason("expert_parallel", "")
        allowed = engine_rules(name).stages_up_to(rule.max_zero_stage)
        return "zero_stage", f"{why}; with MoE blocks {name} supports zero_stage {allowed} only"
    if plan.pp > 1 and not rule.with_pipeline:
        return "pp", f"{name} runs MoE blocks without a pipeline; with MoE blocks pp must be 1"
    if moe.router not in rule.routers:
        return "engine", f"{name} has no {moe.router} router; its MoE routers: {', '.join(rule.routers)}"
    if plan.tp > 1 and not plan.sequence_parallel and rule.tp_needs_sequence_parallel:
        return "sequence_parallel", f"{name} runs MoE blocks with tp > 1 only with sequence_parallel on"
    stage_ranks = plan.dp * plan.cp * plan.tp
    if stage_ranks % (plan.ep * plan.expert_tp):
        folded = plan.ep * plan.expert_tp
        return (
            "ep",
            f"ep·expert_tp = {folded} does not divide the {stage_ranks} ranks of a pipeline stage (dp·cp·tp)",
        )
    return None


def plan_problem(
    plan: Plan, model: ModelSpec, cluster: ClusterSpec | None = None, workload: Workload | None = None
) -> tuple[str, str] | None:
    """The first reason `plan` cannot run `model` on `cluster` for `workload`, as (field, message).

    Checks dp·tp·pp·cp = GPUs, tp divides attention and KV heads and fits in one node (TP all-reduces
    every layer and needs NVLink), cp fits the engine's context-parallel rule, every model chunk holds a block
    (pp·virtual_stages ≤ layers; uneven chunks are priced as costmodel/memory.py `stage_layers` lays them
    out), the batch split matches the workload's global
    batch and the sequence splits into the engine's context-parallel chunks.
    """
    own = plan_only_problem(plan)
    if own:
        return own
    if model.num_attention_heads % plan.tp:
        return "tp", f"tp {plan.tp} does not divide num_attention_heads {model.num_attention_heads}"
    if model.kv_heads % plan.tp:
        return "tp", f"tp {plan.tp} does not divide num_key_value_heads {model.kv_heads}"
    rule = engine_rules(plan.engine).context_parallel
    if rule.heads_divisible and (model.num_attention_heads // plan.tp) % plan.cp:
        heads = model.num_attention_heads // plan.tp
        return "cp", f"Ulysses cp {plan.cp} does not divide the {heads} attention heads per TP rank"
    if plan.pp > model.num_layers:
        return "pp", f"pp {plan.pp} exceeds num_layers {model.num_layers}: a stage would hold no block"
    if plan.pp * plan.virtual_stages > model.num_layers:
        chunks = plan.pp * plan.virtual_stages
        return "virtual_stages", f"pp·virtual_stages = {chunks} exceeds num_layers {model.num_layers}"
    moe = _moe_problem(plan, model)
    if moe:
        return moe
    zero_ranks = plan.dp * plan.cp  # the ranks ZeRO shards over (costmodel/context.py)
    if zero_ranks % plan.zero_hpz_partition_size:
        hpz = plan.zero_hpz_partition_size
        message = f"hpZ group {hpz} does not divide the {zero_ranks} ZeRO ranks (dp·cp)"
        return "zero_hpz_partition_size", message
    if plan.shard_group_size and zero_ranks % plan.shard_group_size:
        group = plan.shard_group_size
        return "shard_group_size", f"shard group {group} does not divide the {zero_ranks} ZeRO ranks (dp·cp)"
    if cluster is not None:
        if plan.num_gpus != cluster.num_gpus:
            return "dp", f"dp·tp·pp·cp = {plan.num_gpus} but the cluster has {cluster.num_gpus} GPUs"
        if plan.tp > cluster.gpus_per_node or cluster.gpus_per_node % plan.tp:
            return "tp", f"tp {plan.tp} must divide gpus_per_node {cluster.gpus_per_node}"
        if plan.precision == "fp8" and not cluster.gpu.peak_tflops_fp8:
            # Transformer Engine's FP8 GEMMs need FP8 tensor cores (Hopper, Ada, Blackwell).
            return "precision", f"{cluster.gpu.name} has no FP8 tensor cores; allowed: bf16, fp16, fp32"
        if cluster.gpus_per_node % plan.zero_hpz_partition_size:
            # hpZ's secondary partition sits inside a node so that backward gathers over NVLink.
            hpz = plan.zero_hpz_partition_size
            message = f"hpZ group {hpz} must divide gpus_per_node {cluster.gpus_per_node}"
            return "zero_hpz_partition_size", message
    if workload is not None and plan.sequences_per_step != workload.batch_sequences:
        return (
            "grad_accum",
            f"micro_batch·grad_accum·dp = {plan.sequences_per_step} but the global batch is "
            f"{workload.batch_sequences} sequences",
        )
    chunks = plan.cp * rule.seq_chunks_per_rank
    if workload is not None and plan.cp > 1 and workload.seq_len % chunks:
        return "cp", f"seq_len {workload.seq_len} does not split into {chunks} {rule.style} chunks"
    takes, m, pp = engine_rules(plan.engine).interleaved_microbatches, plan.grad_accum, plan.pp
    if workload is not None and plan.virtual_stages > 1:
        if takes == "multiple_of_pp" and m % pp:
            return (
                "grad_accum",
                f"{plan.engine}'s interleaved schedule takes micro-batches in groups of pp {pp}: "
                f"grad_accum {m} is not a multiple",
            )
        if takes == "rounds_of_pp" and m % max(1, m // pp):
            rounds = max(1, m // pp)
            return (
                "grad_accum",
                f"{plan.engine}'s interleaved schedule runs grad_accum {m} in {rounds} rounds "
                f"of pp {pp}: not a multiple of the rounds",
            )
    return None


# The field a plan_problem answer blames, counted as the layout field's own fault when listing what that
# field could be instead: a width that does not divide the cluster shows up as dp's sum, too many
# pipeline chunks as virtual_stages.
_LAYOUT_BLAME = {"tp": {"tp", "dp"}, "pp": {"pp", "dp", "virtual_stages"}, "cp": {"cp", "dp"}}


def allowed_values(field: str, plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> list[int]:
    """The values of layout field `field` (tp, pp or cp) that `plan_problem` accepts for `plan`, its
    other fields unchanged and dp refilled to the cluster's GPUs: what an error can offer instead.

    A value is kept when the plan passes or fails only on another field (micro-batch, ZeRO stage, ...),
    so the list answers "which tp would do", not "which whole plan would"."""
    if field not in _LAYOUT_BLAME:
        raise ValueError(f"allowed_values: field must be one of {sorted(_LAYOUT_BLAME)}, got {field!r}")
    limit = {"tp": cluster.gpus_per_node, "pp": model.num_layers, "cp": cluster.num_gpus}[field]
    ok = []
    for value in range(1, limit + 1):
        values = {**plan.model_dump(), field: value}
        width = values["tp"] * values["pp"] * values["cp"]
        if cluster.num_gpus % width:
            continue
        values["dp"] = cluster.num_gpus // width
        problem = plan_problem(Plan.model_construct(**values), model, cluster)
        if problem is None or problem[0] not in _LAYOUT_BLAME[field]:
            ok.append(value)
    return ok


def check_plan(
    plan: Plan, model: ModelSpec, cluster: ClusterSpec | None = None, workload: Workload | None = None
) -> Plan:
    """Returns `plan`, or raises `SpecError` naming the field at fault."""
    problem = plan_problem(plan, model, cluster, workload)
    if problem:
        raise SpecError(f"plan.{problem[0]}", problem[1])
    return plan
