"""Every candidate plan for a cluster, and a vectorised copy of `plan_problem` to filter them.

Candidates are the full cross product of the plan's choices: every factorisation dp·tp·pp·cp of the
cluster's GPUs, ZeRO stages 0–3, optimizer and parameter offload on/off, power-of-two micro-batches up
to a cap, the three recompute policies and sequence parallel on/off. `grad_accum` is not a choice: it
follows from the global batch, `global_batch_sequences = micro_batch · grad_accum · dp`; where that does
not divide, the candidate gets the nearest lower value and the batch rule rejects it.

Candidates also span the engines asked for (deepspeed, fsdp, megatron), megatron's interleaved chunks
per stage, context-parallel degrees up to a cap and, where asked, several precisions.

`service.spec.plan_checks.plan_problem` is the one rule set that decides validity; `problem_codes`
(service/plans/rules.py) restates it on numpy columns, and tests check that both agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from service.plans.pages import with_ordinary_pages
from service.plans.rules import (  # noqa: F401  (re-exported: the rule codes belong to enumeration)
    COMBINATION_REASONS,
    INVALID_REASONS,
    VALID,
    expansion_codes,
    problem_codes,
    reason_code,
)
from service.spec.engine import engine_rules
from service.spec.hardware import ClusterSpec
from service.spec.model import ModelSpec
from service.spec.plan import Engine, Plan, Precision
from service.spec.plan_table import ENGINE_CODES, PRECISION_CODES, PlanTable, concat
from service.spec.workload import Workload

DEFAULT_MAX_MICRO_BATCH = 64
# Largest context-parallel degree tried: Llama 3 405B's long-context stage ran cp 16 (Dubey et al. 2024,
# "The Llama 3 Herd of Models", Table 4); cp beyond it leaves chunks too short to hide the passes.
DEFAULT_MAX_CP = 16
# Interleaved 1F1B chunks per stage tried for megatron and fsdp plans (1 = plain 1F1B). NeMo's Llama-3-70B
# recipe runs pp 4 with 5 chunks per stage (80 layers); 2-4 are the usual choices (Narayanan et al.
# 2021, §2.2.2; Korthikanti et al. 2022, Table 3, 3 chunks).
DEFAULT_VIRTUAL_STAGES = (1, 2, 3, 4, 5)


def factorisations(num_gpus: int, max_cp: int = 1) -> list[tuple[int, int, int, int]]:
    """Every (dp, tp, pp, cp) of positive integers with dp·tp·pp·cp = num_gpus and cp ≤ `max_cp`."""
    divisors = [d for d in range(1, num_gpus + 1) if num_gpus % d == 0]
    return [
        (num_gpus // (tp * pp * cp), tp, pp, cp)
        for cp in divisors
        if cp <= max_cp
        for tp in divisors
        for pp in divisors
        if num_gpus % (tp * pp * cp) == 0
    ]


def micro_batches(max_micro_batch: int) -> list[int]:
    """Powers of two 1, 2, 4, … up to `max_micro_batch`."""
    return [1 << k for k in range(max(0, max_micro_batch).bit_length()) if 1 << k <= max_micro_batch]


def _grid(*axes: np.ndarray) -> list[np.ndarray]:
    """The cross product of `axes` as flat columns (first axis varies slowest)."""
    return [g.ravel() for g in np.meshgrid(*axes, indexing="ij")]


_FLAGS = np.array([False, True])


def _engine_structures(shapes: np.ndarray, engine: Engine, virtual_stages: Sequence[int]) -> PlanTable:
    """One engine's rows: every shape × ZeRO stage × offload flags × sequence parallel (× interleaved
    chunks where the engine has an interleaved schedule: megatron and fsdp, not DeepSpeed's 1F1B)."""
    rules = engine_rules(engine)
    vs = np.array(virtual_stages if rules.interleaved_pipeline else [1], dtype=np.int64)
    shape_i, zero, off_opt, off_par, sp, v = _grid(
        np.arange(len(shapes)), np.arange(4), _FLAGS, _FLAGS, _FLAGS, vs
    )
    ones = np.ones(len(shape_i), dtype=np.int64)
    return PlanTable.from_columns(
        dp=shapes[shape_i, 0],
        tp=shapes[shape_i, 1],
        pp=shapes[shape_i, 2],
        cp=shapes[shape_i, 3],
        zero_stage=zero,
        offload_optimizer=off_opt,
        offload_params=off_par,
        micro_batch=ones,
        grad_accum=ones,
        recompute=ones * 0,
        sequence_parallel=sp,
        precision=ones * 0,
        virtual_stages=v,
        engine=ones * ENGINE_CODES.index(engine),
        # A team choosing an engine with overlaps (Megatron-Core) runs them on, as NVIDIA's recipes do
        # (the TP overlap where the rules allow it: with sequence parallelism).
        comm_overlap=np.full(len(shape_i), rules.comm_overlap),
        tp_comm_overlap=rules.tp_comm_overlap & sp,
    )


def zero_variants(
    gpus_per_node: int, num_gpus: int, quantized: bool = False
) -> list[tuple[int, int, bool, bool]]:
    """(hpZ size, shard group, qwZ, qgZ) tried on ZeRO-3 plans besides plain ZeRO-3: hpZ in a node
    (DeepSpeed), shard groups of one, two and four nodes' worth of ranks (FSDP's HSDP; a large model's
    states need more than one node to shard over) and, when `quantized` (the
    experiment's `quantized_collectives`), ZeRO++'s full recipe (hpZ + qwZ + qgZ) and quantized
    collectives alone. Each engine's rules keep the ones it has. None on a single node: an hpZ group or a
    shard group of a node is then plain ZeRO-3, and both target the cross-node links (Wang et al. 2023
    §1). Quantized collectives are opt-in: int8 weights and int4 gradients change what a step computes,
    and the cost model does not price the quantization kernels, so they would win ties they may not
    win."""
    n = gpus_per_node
    if num_gpus <= n:
        return []
    zero_plus_plus = [(n, 0, True, True), (1, 0, True, True)] if quantized else []
    groups = [(1, k * n, False, False) for k in (1, 2, 4) if k * n < num_gpus]
    return [(n, 0, False, False), *groups, *zero_plus_plus]


def _with_zero_variants(table: PlanTable, gpus_per_node: int, num_gpus: int, quantized: bool) -> PlanTable:
    """`table` plus, for each of its ZeRO-3 rows, one row per `zero_variants` setting its engine has
    (ZeRO++ on engines with `zero_plus_plus`, shard groups on those with `shard_groups`): a variant an
    engine's table refuses would only add candidates that fail its first rule."""
    extra = []
    for hpz, group, qw, qg in zero_variants(gpus_per_node, num_gpus, quantized):
        field = "shard_groups" if group else "zero_plus_plus"
        z3 = table.take((table.zero_stage == 3) & table.engine_column(field))
        extra.append(
            dataclasses.replace(
                z3,
                zero_hpz_partition_size=np.full(len(z3), hpz, dtype=np.int64),
                shard_group_size=np.full(len(z3), group, dtype=np.int64),
                zero_quantized_weights=np.full(len(z3), qw),
                zero_quantized_gradients=np.full(len(z3), qg),
            )
        )
    return concat([table, *extra])


def expert_degrees(model: ModelSpec | None) -> list[int]:
    """The `ep` degrees tried for `model`: every divisor of its expert count (1 alone for a dense model).
    Expert tensor parallelism is tried at 1 and at tp (`_with_expert_variants`)."""
    if model is None or model.moe is None:
        return [1]
    n = model.moe.num_experts
    return [e for e in range(1, n + 1) if n % e == 0]


def ep_overlap_allowed(table: PlanTable) -> np.ndarray:
    """Where an engine with the all-to-all overlap can turn it on: a team on Megatron-Core runs it, as
    NVIDIA's MoE recipes do, without a pipeline or with the interleaved schedule it needs."""
    overlap = np.array([engine_rules(e).expert_parallel.a2a_overlap for e in ENGINE_CODES])[table.engine]
    return overlap & ((table.pp == 1) | (table.virtual_stages > 1))


def _with_expert_variants(table: PlanTable, model: ModelSpec | None) -> PlanTable:
    """For a MoE model, each row once per `expert_degrees` ep and expert_tp in {1, tp} (the layouts
    NVIDIA's and torchtitan's MoE recipes run; Megatron-Core allows any expert_tp, `outside_space` says
    so); the rules drop the ones a row's ranks or engine cannot hold."""
    degrees = expert_degrees(model)
    if len(degrees) == 1:
        return table
    extra = []
    for ep in degrees:
        for tp_split in (False, True):
            if ep == 1 and not tp_split:
                continue  # the rows themselves
            rows = table.take(table.tp > 1) if tp_split else table
            extra.append(
                dataclasses.replace(
                    rows,
                    ep=np.full(len(rows), ep, dtype=np.int64),
                    expert_tp=rows.tp.copy() if tp_split else np.ones(len(rows), dtype=np.int64),
                    ep_comm_overlap=ep_overlap_allowed(rows) & (ep > 1),
                )
            )
    return concat([table, *extra])


def _structures(
    num_gpus: int,
    max_cp: int = 1,
    engines: Sequence[Engine] = ("deepspeed",),
    virtual_stages: Sequence[int] = DEFAULT_VIRTUAL_STAGES,
    gpus_per_node: int = 8,
    quantized: bool = False,
    model: ModelSpec | None = None,
) -> PlanTable:
    """The rows the structural rules look at, engine by engine: micro_batch 1, grad_accum 1, recompute
    none. ZeRO-3 rows also come with ZeRO++ and shard-group settings (`zero_variants`), and a MoE
    model's rows with expert-parallel layouts (`_with_expert_variants`)."""
    shapes = np.array(factorisations(num_gpus, max_cp), dtype=np.int64)  # (F, 4): dp, tp, pp, cp
    tables = [_engine_structures(shapes, e, virtual_stages) for e in engines]
    table = concat([_with_zero_variants(t, gpus_per_node, num_gpus, quantized) for t in tables])
    return _with_expert_variants(table, model)


def _expand(
    structures: PlanTable, workload: Workload, max_micro_batch: int, precisions: Sequence[Precision]
) -> PlanTable:
    """Each structure × every micro-batch × every recompute policy × every precision, grad_accum from
    the global batch."""
    return _rows(structures, *_expansion(structures, workload, max_micro_batch, precisions))


def _expansion(
    structures: PlanTable, workload: Workload, max_micro_batch: int, precisions: Sequence[Precision]
) -> list[np.ndarray]:
    """[structure row, micro_batch, grad_accum, recompute, precision] of every expanded candidate."""
    row, mb, recompute, precision = _grid(
        np.arange(len(structures)),
        np.array(micro_batches(max_micro_batch), dtype=np.int64),
        np.arange(3),
        np.array([PRECISION_CODES.index(x) for x in precisions], dtype=np.int64),
    )
    grad_accum = np.maximum(workload.batch_sequences // (mb * structures.dp[row]), 1)
    return [row, mb, grad_accum, recompute, precision]


def _rows(
    structures: PlanTable,
    row: np.ndarray,
    mb: np.ndarray,
    grad_accum: np.ndarray,
    recompute: np.ndarray,
    precision: np.ndarray,
) -> PlanTable:
    return dataclasses.replace(
        structures.take(row), micro_batch=mb, grad_accum=grad_accum, recompute=recompute, precision=precision
    )


def _precisions(precision: Precision | Sequence[Precision]) -> tuple[Precision, ...]:
    return (precision,) if isinstance(precision, str) else tuple(precision)


def candidate_table(
    cluster: ClusterSpec,
    workload: Workload,
    max_micro_batch: int = DEFAULT_MAX_MICRO_BATCH,
    precision: Precision | Sequence[Precision] = "bf16",
    max_cp: int = DEFAULT_MAX_CP,
    engines: Sequence[Engine] = ("deepspeed",),
    virtual_stages: Sequence[int] = DEFAULT_VIRTUAL_STAGES,
    quantized_collectives: bool = False,
    model: ModelSpec | None = None,
) -> PlanTable:
    """The full cross product of choices for `cluster` (valid or not), one row per candidate; with a MoE
    `model`, its expert-parallel layouts too."""
    structures = _structures(
        cluster.num_gpus, max_cp, engines, virtual_stages, cluster.gpus_per_node, quantized_collectives, model
    )
    return _expand(structures, workload, max_micro_batch, _precisions(precision))


@dataclass(frozen=True)
class Enumeration:
    """The valid plans of a cluster, and how many candidates each rule turned away."""

    plans: PlanTable
    candidates: int
    invalid_counts: dict[str, int]


def count_codes(codes: np.ndarray) -> dict[str, int]:
    """{short reason: how many rows} for the invalid codes present, most frequent first."""
    return _named_counts(np.bincount(codes, minlength=len(INVALID_REASONS)))


def _named_counts(counts: np.ndarray) -> dict[str, int]:
    pairs = [(INVALID_REASONS[c][0], int(n)) for c, n in enumerate(counts) if c != VALID and n]
    return dict(sorted(pairs, key=lambda kv: -kv[1]))


@with_ordinary_pages
def enumerate_plans(
    model: ModelSpec,
    cluster: ClusterSpec,
    workload: Workload,
    max_micro_batch: int = DEFAULT_MAX_MICRO_BATCH,
    precision: Precision | Sequence[Precision] = "bf16",
    max_cp: int = DEFAULT_MAX_CP,
    engines: Sequence[Engine] = ("deepspeed",),
    virtual_stages: Sequence[int] = DEFAULT_VIRTUAL_STAGES,
    quantized_collectives: bool = False,
) -> Enumeration:
    """Every valid plan for `model` on `cluster` with `workload`'s global batch.

    Same answer as filtering `candidate_table` with `problem_codes`, in two stages for speed: the
    structural rules (all but the batch rule) ignore micro_batch and recompute, so they run once per
    structure, and only the structures that pass are expanded into micro-batches × recompute policies,
    where only the rules of the expanded columns are checked (`expansion_codes`) before any row is built.
    A rejected structure stands for micro-batches × policies rejected candidates in the counts.
    `max_cp`: the largest context-parallel degree tried (1 = none); `engines`: which engines' plans
    (each under its own rules); `virtual_stages`: the interleaved chunks tried for megatron and fsdp plans;
    `quantized_collectives`: also ZeRO++'s quantized weights and gradients (`zero_variants`).
    """
    structures = _structures(
        cluster.num_gpus, max_cp, engines, virtual_stages, cluster.gpus_per_node, quantized_collectives, model
    )
    structure_codes = problem_codes(structures, model, cluster, workload=None)
    precisions = _precisions(precision)
    per_structure = len(micro_batches(max_micro_batch)) * 3 * len(precisions)
    passed = structures.take(structure_codes == VALID)
    row, mb, ga, recompute, prec = _expansion(passed, workload, max_micro_batch, precisions)
    codes = expansion_codes(passed, row, mb, ga, prec, cluster, workload)
    counts = np.bincount(structure_codes, minlength=len(INVALID_REASONS)) * per_structure
    counts += np.bincount(codes, minlength=len(INVALID_REASONS))
    keep = codes == VALID
    plans = _rows(passed, row[keep], mb[keep], ga[keep], recompute[keep], prec[keep])
    return Enumeration(plans, len(structures) * per_structure, _named_counts(counts))


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
    if plan.precision not in _precisions(precision):
        return f"the planner scored {', '.join(_precisions(precision))} plans only"
    return None
