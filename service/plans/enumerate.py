"""Every candidate plan for a cluster, and a vectorised copy of `plan_problem` to filter them.

Candidates are the full cross product of the plan's choices: every factorisation dp·tp·pp·cp of the
cluster's GPUs, ZeRO stages 0–3, optimizer and parameter offload on/off, power-of-two micro-batches up
to a cap, the three recompute policies and sequence parallel on/off. `grad_accum` is not a choice: it
follows from the global batch, `global_batch_sequences = micro_batch · grad_accum · dp`; where that does
not divide, the candidate gets the nearest lower value and the batch rule rejects it.

`service.spec.plan.plan_problem` is the one rule set that decides validity. It is scalar (one `Plan`
at a time, ~10 µs each), too slow for 100,000 plans per second, so `problem_codes` below restates the
same rules on numpy columns, in the same order. tests/plans/test_enumerate.py checks, on every
candidate of several small clusters and on random tables, that both give the same first reason.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from service.plans.table import ENGINE_CODES, PRECISION_CODES, PlanTable
from service.spec.hardware import ClusterSpec
from service.spec.model import ModelSpec
from service.spec.plan import CONTEXT_PARALLEL_RULES, Precision
from service.spec.workload import Workload

# Why a candidate cannot run, in the order `plan_problem` checks its rules (code = index; 0 = valid).
# Each entry: (short reason for counts and tables, the `plan_problem` field, a fragment of its message).
INVALID_REASONS: tuple[tuple[str, str, str], ...] = (
    ("valid", "", ""),
    ("offload_params without zero_stage 3", "offload_params", "parameter offload needs zero_stage 3"),
    ("offload_optimizer with zero_stage 0", "offload_optimizer", "optimizer offload needs zero_stage"),
    ("zero_stage > 1 with pp > 1", "zero_stage", "pipeline parallelism"),
    ("zero_stage 3 with tp > 1", "zero_stage", "tensor parallelism"),
    ("sequence_parallel without tp", "sequence_parallel", "sequence parallelism needs tp > 1"),
    ("tp does not divide attention heads", "tp", "does not divide num_attention_heads"),
    ("tp does not divide KV heads", "tp", "does not divide num_key_value_heads"),
    ("Ulysses cp does not divide heads per TP rank", "cp", "attention heads per TP rank"),
    ("pp does not divide layers", "pp", "does not divide num_layers"),
    ("dp·tp·pp·cp is not the GPU count", "dp", "but the cluster has"),
    ("tp does not divide gpus_per_node", "tp", "must divide gpus_per_node"),
    ("global batch does not split", "grad_accum", "but the global batch is"),
    ("seq_len does not split into cp chunks", "cp", "does not split into"),
)
VALID = 0
# Codes 1-5 are about combining choices (what DeepSpeed supports), never about the model, cluster or
# batch; dp = GPUs alone always passes them, so they never explain why a cluster has no valid plan.
COMBINATION_REASONS = frozenset(reason for reason, _, _ in INVALID_REASONS[1:6])
DEFAULT_MAX_MICRO_BATCH = 64
# Largest context-parallel degree tried: Llama 3 405B's long-context stage ran cp 16 (Dubey et al. 2024,
# "The Llama 3 Herd of Models", Table 4); cp beyond it leaves chunks too short to hide the passes.
DEFAULT_MAX_CP = 16


def reason_code(problem: tuple[str, str] | None) -> int:
    """The code of a `plan_problem` answer: matches its field and message against INVALID_REASONS."""
    if problem is None:
        return VALID
    field, message = problem
    for code, (_, reason_field, fragment) in enumerate(INVALID_REASONS):
        if code and field == reason_field and fragment in message:
            return code
    raise ValueError(f"plan_problem gave a reason the planner does not know: {problem}")


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


def _structures(num_gpus: int, max_cp: int = 1) -> PlanTable:
    """One row per (dp, tp, pp, cp, zero_stage, offload_optimizer, offload_params, sequence_parallel):
    the choices the structural rules look at. micro_batch 1, grad_accum 1, recompute none."""
    shapes = np.array(factorisations(num_gpus, max_cp), dtype=np.int64)  # (F, 4): dp, tp, pp, cp
    shape_i, zero, off_opt, off_par, sp = _grid(np.arange(len(shapes)), np.arange(4), _FLAGS, _FLAGS, _FLAGS)
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
    )


def _expand(
    structures: PlanTable, workload: Workload, max_micro_batch: int, precision: Precision
) -> PlanTable:
    """Each structure × every micro-batch × every recompute policy, grad_accum from the global batch."""
    row, mb, recompute = _grid(
        np.arange(len(structures)), np.array(micro_batches(max_micro_batch), dtype=np.int64), np.arange(3)
    )
    s = structures.take(row)
    return dataclasses.replace(
        s,
        micro_batch=mb,
        grad_accum=np.maximum(workload.batch_sequences // (mb * s.dp), 1),
        recompute=recompute,
        precision=np.full(len(row), PRECISION_CODES.index(precision), dtype=np.int64),
    )


def candidate_table(
    cluster: ClusterSpec,
    workload: Workload,
    max_micro_batch: int = DEFAULT_MAX_MICRO_BATCH,
    precision: Precision = "bf16",
    max_cp: int = DEFAULT_MAX_CP,
) -> PlanTable:
    """The full cross product of choices for `cluster` (valid or not), one row per candidate."""
    return _expand(_structures(cluster.num_gpus, max_cp), workload, max_micro_batch, precision)


def problem_codes(
    plans: PlanTable, model: ModelSpec, cluster: ClusterSpec | None = None, workload: Workload | None = None
) -> np.ndarray:
    """Per row, the code (index into INVALID_REASONS) of the first rule `plan_problem` would break.

    The same rules in the same order as service/spec/plan.py; np.select takes the first true one.
    """
    p = plans
    cp_rules = [CONTEXT_PARALLEL_RULES[e] for e in ENGINE_CODES]
    heads_rule = np.array([r.heads_divisible for r in cp_rules])[p.engine]
    chunks = p.cp * np.array([r.seq_chunks_per_rank for r in cp_rules])[p.engine]
    rules = [
        p.offload_params & (p.zero_stage != 3),
        p.offload_optimizer & (p.zero_stage == 0),
        (p.pp > 1) & (p.zero_stage > 1),
        (p.tp > 1) & (p.zero_stage == 3),
        p.sequence_parallel & (p.tp == 1),
        model.num_attention_heads % p.tp != 0,
        model.kv_heads % p.tp != 0,
        heads_rule & ((model.num_attention_heads // p.tp) % p.cp != 0),
        model.num_layers % p.pp != 0,
    ]
    if cluster is not None:
        gpus_per_node = cluster.gpus_per_node
        rules.append(p.dp * p.tp * p.pp * p.cp != cluster.num_gpus)
        rules.append((p.tp > gpus_per_node) | (gpus_per_node % p.tp != 0))
    else:
        rules += [np.zeros(len(p), bool)] * 2
    if workload is not None:
        rules.append(p.micro_batch * p.grad_accum * p.dp != workload.batch_sequences)
        rules.append((p.cp > 1) & (workload.seq_len % chunks != 0))
    else:
        rules += [np.zeros(len(p), bool)] * 2
    return np.select(rules, list(range(1, len(rules) + 1)), default=VALID).astype(np.int8)


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


def enumerate_plans(
    model: ModelSpec,
    cluster: ClusterSpec,
    workload: Workload,
    max_micro_batch: int = DEFAULT_MAX_MICRO_BATCH,
    precision: Precision = "bf16",
    max_cp: int = DEFAULT_MAX_CP,
) -> Enumeration:
    """Every valid plan for `model` on `cluster` with `workload`'s global batch.

    Same answer as filtering `candidate_table` with `problem_codes`, in two stages for speed: the
    structural rules (all but the batch rule) ignore micro_batch and recompute, so they run once per
    structure, and only the structures that pass are expanded into micro-batches × recompute policies.
    A rejected structure stands for micro-batches × policies rejected candidates in the counts.
    `max_cp`: the largest context-parallel degree tried (1 = none).
    """
    structures = _structures(cluster.num_gpus, max_cp)
    structure_codes = problem_codes(structures, model, cluster, workload=None)
    per_structure = len(micro_batches(max_micro_batch)) * 3
    expanded = _expand(structures.take(structure_codes == VALID), workload, max_micro_batch, precision)
    codes = problem_codes(expanded, model, cluster, workload)
    counts = np.bincount(structure_codes, minlength=len(INVALID_REASONS)) * per_structure
    counts += np.bincount(codes, minlength=len(INVALID_REASONS))
    return Enumeration(expanded.take(codes == VALID), len(structures) * per_structure, _named_counts(counts))
