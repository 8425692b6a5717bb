"""Ranking without scoring the layouts that cannot win: a lower bound on each structure's step time.

A structure is a plan without its micro-batch, gradient accumulation, recompute policy and precision
(service/plans/enumerate.py); it expands into up to micro-batches × 3 × precisions plans. Every
step-time term (costmodel/step_time.py) is either non-increasing in the micro-batch for a fixed global
batch, or bounded below by 0:
- the GEMM, attention and element-wise work per token falls as a larger micro-batch fills the tiles
  (`compute.gemm_time_s`: tile fill and operand traffic per token both fall with m), and each
  collective's latency is paid fewer times: compute, the TP, CP, PP and expert exchanges without
  overlap, data-parallel traffic, offload and the per-micro-step overhead are smallest at the largest
  micro-batch, with no recompute (which only adds work), in the cheaper of the precisions;
- the pipeline bubble grows with the micro-batch and the 1F1B all-to-all overlap hides more the more
  micro-batches it pairs (expert_exchange.paired_exposed_s): both are bounded by 0;
- a MoE block pass's wait for the host (`host_wait`, ga · max(0, floor − pass): compute.moe_host_floor_s)
  falls as the micro-batch grows; recompute and the slower precision shrink it, but by no more than they
  add to the pass, so the wait plus the pass's terms is still smallest where the bound takes them.
The sum of the terms' minima is at most the step time of any of the structure's plans, so a structure
whose bound is slower than the best plan found by more than the model's resolution holds no plan that
could be selected or tie with the choice. tests/plans/test_bound.py checks the bound against every
valid plan of dense and MoE spaces on every engine, and that the pruned ranking selects and orders its
top plans as the exhaustive one does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from service.plans.enumerate import Expansions, micro_batches
from service.spec.hardware import ClusterSpec
from service.spec.model import ModelSpec
from service.spec.params import ModelParams
from service.spec.plan import Precision
from service.spec.plan_table import PRECISION_CODES, PlanTable, concat
from service.spec.workload import Workload

# How a bounded ranking counts the plans it did not score (`Ranking.rejected_counts`).
PRUNED_STATUS = "slower (bounded, not scored)"
# Terms bounded by 0 rather than by their value at the largest micro-batch (see the module docstring).
ZERO_BOUNDED_TERMS = ("bubble",)


def bound_micro_batch(structures: PlanTable, workload: Workload, max_micro_batch: int) -> np.ndarray:
    """The largest micro-batch a structure's plans can take: the largest tried power of two that divides
    a data-parallel rank's share of the global batch (the batch rule: micro_batch · grad_accum · dp is
    the batch); 0 where none does."""
    per_rank = np.where(
        workload.batch_sequences % structures.dp == 0, workload.batch_sequences // structures.dp, 0
    )
    tried = np.array(micro_batches(max_micro_batch), dtype=np.int64)
    fits = (per_rank[:, None] % tried[None, :] == 0) & (per_rank[:, None] > 0)
    largest = np.where(fits, tried[None, :], 0)
    return np.asarray(largest.max(axis=1, initial=0), dtype=np.int64)


def bound_rows(
    structures: PlanTable, workload: Workload, largest_mb: np.ndarray, precisions: Sequence[Precision]
) -> PlanTable:
    """Each structure once per precision (precision-major) at its largest micro-batch
    (`bound_micro_batch`), no recompute."""
    mb = np.maximum(largest_mb, 1)
    ga = np.maximum(workload.batch_sequences // (structures.dp * mb), 1)  # exact where mb is not 0
    zeros = np.zeros(len(structures), dtype=np.int64)
    return concat(
        [
            dataclasses.replace(
                structures,
                micro_batch=mb,
                grad_accum=ga,
                recompute=zeros,
                precision=zeros + PRECISION_CODES.index(precision),
            )
            for precision in precisions
        ]
    )


def structure_bound_s(
    model: ModelSpec,
    cluster: ClusterSpec,
    workload: Workload,
    structures: PlanTable,
    max_micro_batch: int,
    precisions: Sequence[Precision],
    params: ModelParams,
) -> np.ndarray:
    """Seconds per step no plan of each structure beats (inf where no micro-batch fits its batch)."""
    from service.costmodel.step_time import step_time_terms

    n, largest_mb = len(structures), bound_micro_batch(structures, workload, max_micro_batch)
    rows = bound_rows(structures, workload, largest_mb, precisions)
    total = np.zeros(n)
    for name, term in step_time_terms(model, cluster, workload, rows, params).items():
        if name in ZERO_BOUNDED_TERMS:
            continue
        values = np.broadcast_to(np.asarray(term, dtype=float), (len(rows),))
        if name == "ep_comm":
            values = np.where(rows.ep_comm_overlap, 0.0, values)
        total += values.reshape(len(precisions), n).min(axis=0)
    return np.where(largest_mb > 0, total, np.inf)


@dataclass(frozen=True)
class Pruning:
    """What the bounded ranking skipped: `structures` layouts holding `plans` valid plans, each bounded
    worse on the objective than `threshold` (`select.objective_values`: the best plan, `best`, widened
    by its tie resolution and as far as the `keep_top`-th plan), so none of them could be selected, tie
    with the choice or rank in the top."""

    structures: int
    plans: int
    threshold: float
    best: float


# Bound and score reach the objective by different float arithmetic (step/N against 1/(N/step)): a
# layout whose bound equals its plan's step time can land one ulp above the plan's own value. Layouts
# within this relative margin of the limit are scored.
ROUNDING_MARGIN = 1e-9
# The first round scores the structures with the lowest bounds until this many plans (doubling until one
# fits and meets the budget), to find the best plan the others are measured against.
FIRST_ROUND_PLANS = 16_384


def objective_of_step(
    step_s: np.ndarray, objective: str, workload: Workload, hours_of: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    """What `select.objective_values` compares, for plans of step time `step_s` on one global batch:
    1 / tokens/s for throughput, the run's hours for cost (`hours_of`: failure-free hours to the run's
    expected wall-clock; both increase with the step time)."""
    seconds_per_token = np.asarray(step_s, dtype=float) / (workload.batch_sequences * workload.seq_len)
    if objective != "cost":
        return seconds_per_token
    return hours_of(workload.tokens_to_train * seconds_per_token / 3600.0)


def prune_structures(
    found: Expansions,
    bound_s: np.ndarray,
    score: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]],
    objective_of: Callable[[np.ndarray], np.ndarray],
    keep_top: int = 0,
) -> tuple[np.ndarray, Pruning | None]:
    """Which structures to score: those whose bound could still reach the best plan's tie group or the
    `keep_top` best. `score(keep)` scores the plans of the structures `keep` marks and returns, per plan,
    its objective value (`select.objective_values`), whether it is feasible (fits and meets the budget)
    and its tie resolution (`select.tie_resolution`); `objective_of` maps step seconds to objective
    values. Returns the mask of structures to rank and what was skipped (None when no plan scored was
    feasible: then every structure is ranked).

    Three rounds: the structures with the lowest bounds until one feasible plan is found (the
    incumbent); those again with every structure whose bound reaches the incumbent, which holds the best
    plan, and so its tie resolution; every structure whose bound reaches the best widened by that
    resolution, or the `keep_top`-th feasible plan of the second round (no better than the true
    `keep_top`-th: the second round scores a subset)."""
    plans_per = found.per_structure()
    everything = plans_per > 0
    order = np.argsort(bound_s, kind="stable")
    order = order[everything[order]]
    cumulative = np.cumsum(plans_per[order])
    want = FIRST_ROUND_PLANS
    while True:
        first = np.zeros(len(bound_s), dtype=bool)
        first[order[: int(np.searchsorted(cumulative, want)) + 1]] = True
        values, feasible, _ = score(first)
        if feasible.any() or first[order].all():
            break
        want *= 4
    if not feasible.any():
        return everything, None
    bound_objective = objective_of(bound_s)
    # the first round's structures again, so the second round's feasible plans are all those scored
    incumbent = values[feasible].min() * (1 + ROUNDING_MARGIN)
    values, feasible, resolution = score(first | (everything & (bound_objective <= incumbent)))
    best = values[feasible].min()
    limit = best * np.exp(resolution[feasible & (values == best)].max())
    ranked = np.sort(values[feasible])
    if keep_top > 0:
        limit = max(limit, ranked[keep_top - 1] if len(ranked) >= keep_top else np.inf)
    keep = everything & (bound_objective <= limit * (1 + ROUNDING_MARGIN))
    skipped = everything & ~keep
    return keep, Pruning(int(skipped.sum()), int(plans_per[skipped].sum()), float(limit), float(best))
