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
    EXPANSION_CODES,
    INVALID_REASONS,
    VALID,
    expert_variant_codes,
    micro_batch_codes,
    precision_codes,
    problem_codes,
    reason_code,
)
from service.spec.engine import engine_rules
from service.spec.hardware import ClusterSpec
from service.spec.model import ModelSpec
from service.spec.plan import Engine, Precision
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


def _with_expert_variants(table: PlanTable, model: ModelSpec | None) -> list[tuple[PlanTable, np.ndarray]]:
    """For a MoE model, each row once per `expert_degrees` ep and expert_tp in {1, tp} (the layouts
    NVIDIA's and torchtitan's MoE recipes run; Megatron-Core allows any expert_tp, `outside_space` says
    so); the rules drop the ones a row's ranks or engine cannot hold. One (table, rows of `table` it was
    made from) per (ep, expert_tp) variant, `table` itself first: a large MoE space is filtered part by
    part (`rules.expert_variant_codes`), never concatenated whole."""
    degrees = expert_degrees(model)
    parts = [(table, np.arange(len(table)))]
    for ep in degrees if len(degrees) > 1 else []:
        for tp_split in (False, True):
            if ep == 1 and not tp_split:
                continue  # the rows themselves
            base = np.flatnonzero(table.tp > 1) if tp_split else np.arange(len(table))
            rows = table.take(base) if tp_split else table  # the variant shares the rest of its columns
            variant = dataclasses.replace(
                rows,
                ep=np.full(len(rows), ep, dtype=np.int64),
                expert_tp=rows.tp.copy() if tp_split else np.ones(len(rows), dtype=np.int64),
                ep_comm_overlap=ep_overlap_allowed(rows) & (ep > 1),
            )
            parts.append((variant, base))
    return parts


def _structures(
    num_gpus: int,
    max_cp: int = 1,
    engines: Sequence[Engine] = ("deepspeed",),
    virtual_stages: Sequence[int] = DEFAULT_VIRTUAL_STAGES,
    gpus_per_node: int = 8,
    quantized: bool = False,
    model: ModelSpec | None = None,
) -> list[tuple[PlanTable, np.ndarray]]:
    """The rows the structural rules look at, engine by engine, in parts (`_with_expert_variants`):
    micro_batch 1, grad_accum 1, recompute none. ZeRO-3 rows also come with ZeRO++ and shard-group
    settings (`zero_variants`), and a MoE model's rows with expert-parallel layouts."""
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


def precisions_of(precision: Precision | Sequence[Precision]) -> tuple[Precision, ...]:
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
    parts = _structures(
        cluster.num_gpus, max_cp, engines, virtual_stages, cluster.gpus_per_node, quantized_collectives, model
    )
    return _expand(concat([part for part, _ in parts]), workload, max_micro_batch, precisions_of(precision))


@dataclass(frozen=True)
class Enumeration:
    """The valid plans of a cluster, and how many candidates each rule turned away."""

    plans: PlanTable
    candidates: int
    invalid_counts: dict[str, int]


@dataclass(frozen=True)
class Expansions:
    """The structures that pass the structural rules and their valid expansions, before any plan row is
    built: pair i is structure `row[i]` at `micro_batch[i]` and `grad_accum[i]`, and every pair expands
    into the three recompute policies × `precisions` (codes; those the GPU runs). `plans(keep)` builds
    the rows of the structures `keep` marks (all by default), in `candidate_table`'s order."""

    structures: PlanTable
    row: np.ndarray
    micro_batch: np.ndarray
    grad_accum: np.ndarray
    precisions: np.ndarray
    candidates: int
    invalid_counts: dict[str, int]

    def plans(self, keep: np.ndarray | None = None) -> PlanTable:
        pairs = slice(None) if keep is None else keep[self.row]
        row, mb, ga = self.row[pairs], self.micro_batch[pairs], self.grad_accum[pairs]
        per_pair = 3 * len(self.precisions)
        recompute = np.tile(np.repeat(np.arange(3), len(self.precisions)), len(row))
        precision = np.tile(self.precisions, 3 * len(row))
        row, mb, ga = (np.repeat(x, per_pair) for x in (row, mb, ga))
        return _rows(self.structures, row, mb, ga, recompute, precision)

    def plan_structures(self) -> np.ndarray:
        """The structure (row of `structures`) of each plan `plans()` builds."""
        return np.repeat(self.row, 3 * len(self.precisions))

    def per_structure(self) -> np.ndarray:
        """How many valid plans each structure expands into."""
        return np.bincount(self.row, minlength=len(self.structures)) * 3 * len(self.precisions)


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
    where only the rules of the expanded columns are checked (`micro_batch_codes`, `precision_codes`)
    before any row is built.
    A rejected structure stands for micro-batches × policies rejected candidates in the counts.
    `max_cp`: the largest context-parallel degree tried (1 = none); `engines`: which engines' plans
    (each under its own rules); `virtual_stages`: the interleaved chunks tried for megatron and fsdp plans;
    `quantized_collectives`: also ZeRO++'s quantized weights and gradients (`zero_variants`).
    """
    found = expand_structures(
        model, cluster, workload, max_micro_batch, precision, max_cp, engines, virtual_stages,
        quantized_collectives,
    )  # fmt: skip
    return Enumeration(found.plans(), found.candidates, found.invalid_counts)


@with_ordinary_pages
def expand_structures(
    model: ModelSpec,
    cluster: ClusterSpec,
    workload: Workload,
    max_micro_batch: int = DEFAULT_MAX_MICRO_BATCH,
    precision: Precision | Sequence[Precision] = "bf16",
    max_cp: int = DEFAULT_MAX_CP,
    engines: Sequence[Engine] = ("deepspeed",),
    virtual_stages: Sequence[int] = DEFAULT_VIRTUAL_STAGES,
    quantized_collectives: bool = False,
) -> Expansions:
    """`enumerate_plans` up to the point where rows are built (its arguments, its counts)."""
    parts = _structures(
        cluster.num_gpus, max_cp, engines, virtual_stages, cluster.gpus_per_node, quantized_collectives, model
    )
    precisions = precisions_of(precision)
    per_structure = len(micro_batches(max_micro_batch)) * 3 * len(precisions)
    counts = np.zeros(len(INVALID_REASONS), dtype=np.int64)
    passed_parts = []
    base_codes = problem_codes(parts[0][0], model, cluster, workload=None)
    for i, (part, base) in enumerate(parts):
        structure_codes = expert_variant_codes(part, model, base_codes[base]) if i else base_codes
        counts += np.bincount(structure_codes, minlength=len(INVALID_REASONS)) * per_structure
        passed_parts.append(part.take(structure_codes == VALID))
    passed = concat(passed_parts)
    row, mb, ga, codes = _micro_batch_pairs(passed, workload, max_micro_batch)
    prec = np.array([PRECISION_CODES.index(x) for x in precisions], dtype=np.int64)
    runs = precision_codes(prec, cluster) == VALID
    # Per (structure, micro-batch) pair: 3 recompute policies × each precision. A precision the GPU lacks
    # is refused first (its rule comes before the batch rules), the others take the pair's code.
    counts += np.bincount(codes, minlength=len(INVALID_REASONS)) * 3 * int(runs.sum())
    counts[EXPANSION_CODES[0]] += len(row) * 3 * int((~runs).sum())
    keep = codes == VALID
    return Expansions(
        passed, row[keep], mb[keep], ga[keep], prec[runs],
        sum(len(part) for part, _ in parts) * per_structure, _named_counts(counts),
    )  # fmt: skip


def _micro_batch_pairs(
    passed: PlanTable, workload: Workload, max_micro_batch: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every (structure, micro-batch) pair of structures that pass the structural rules, with its
    grad_accum and the code of the rules it can still break (the batch, sequence-split and interleave
    rules read the structure and its micro-batch alone), structure-major as `_grid` orders them."""
    row, mb = _grid(np.arange(len(passed)), np.array(micro_batches(max_micro_batch), dtype=np.int64))
    ga = np.maximum(workload.batch_sequences // (mb * passed.dp[row]), 1)
    return row, mb, ga, micro_batch_codes(passed, row, mb, ga, workload)
