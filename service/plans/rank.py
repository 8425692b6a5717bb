"""The ranking itself: enumerate, score in one vectorised pass, select (`rank_plans`), and the bounded
variant that skips the layouts which cannot win (service/plans/bound.py). `service.planner` wraps it
into the Python API; `plan`, `run` and the API all rank through `rank_plans`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from service.costmodel.result import EstimateTable
from service.plans.bound import (
    PRUNED_STATUS,
    Pruning,
    objective_of_step,
    prune_structures,
    structure_bound_s,
)
from service.plans.enumerate import DEFAULT_MAX_MICRO_BATCH, Enumeration, Expansions, expand_structures
from service.plans.pages import with_ordinary_pages
from service.plans.select import (
    SELECTED,
    Selection,
    objective_values,
    plan_statuses,
    select_plan,
    tie_resolution,
)
from service.spec import Budget, ClusterSpec, ModelSpec, Workload
from service.spec.params import ModelParams, load_params
from service.spec.plan import Engine, Precision
from service.spec.plan_table import PlanTable
from service.spec.production import GoodputSpec


@dataclass(frozen=True)
class Ranking:
    """What `rank_plans` returns: the valid plans, their scores and the selection (row indexes).
    `hours_no_failures` is the failure-free hours; `estimates.hours` (and dollars) include goodput
    when `rank_plans` was given it, and equal them otherwise."""

    enumeration: Enumeration
    estimates: EstimateTable
    selection: Selection
    hours_no_failures: np.ndarray
    pruning: Pruning | None = None  # what a bounded ranking did not score (`rank_plans(prune=True)`)

    def rejected_counts(self) -> dict[str, int]:
        """Why every candidate but the selected one lost: invalid (by rule), then by selection status
        (and, in a bounded ranking, the plans whose layout's bound is slower than the choice's tie)."""
        invalid = {f"invalid: {reason}": n for reason, n in self.enumeration.invalid_counts.items()}
        bounded = {PRUNED_STATUS: self.pruning.plans} if self.pruning and self.pruning.plans else {}
        return {**invalid, **self.selection.counts(), **bounded}


@with_ordinary_pages
def rank_plans(
    model: ModelSpec,
    cluster: ClusterSpec,
    workload: Workload,
    budget: Budget,
    max_micro_batch: int = DEFAULT_MAX_MICRO_BATCH,
    precision: Precision = "bf16",
    params: ModelParams | None = None,
    engines: Sequence[Engine] = ("deepspeed",),
    quantized_collectives: bool = False,
    goodput: GoodputSpec | None = None,
    enumeration: Enumeration | None = None,
    time_unfit: bool = False,
    prune: bool = False,
    keep_top: int = 0,
) -> Ranking:
    """Enumerates every valid plan of `engines` (or takes `enumeration`, already made for this cluster),
    scores them all with `estimate_table` under `params` (None = the shipped set), and selects under
    `budget`. With `goodput`, hours and dollars are the run's expected wall-clock, interruptions,
    checkpoints and restarts included (service/costmodel/goodput.py), so the budget is checked against
    what the run will really cost. Plans that do not fit in memory are not timed (NaN time and cost
    columns: they lose on memory alone) unless `time_unfit`, for a report that prints their time.
    The one ranking of `plan`, `run` and the Python API.

    `prune`: score only the layouts whose lower bound on the step time (service/plans/bound.py) could
    reach the best plan's tie group or the `keep_top` best plans: the same selection, tie group and top
    `keep_top` as the exhaustive ranking, the rest counted as `PRUNED_STATUS` and left out of the table."""
    from service.costmodel import estimate_table
    from service.costmodel.goodput import with_goodput

    if prune and enumeration is not None:
        raise ValueError("prune skips layouts while it enumerates them: pass prune or enumeration, not both")
    params = load_params() if params is None else params

    def score(plans: PlanTable) -> tuple[EstimateTable, EstimateTable]:
        raw = estimate_table(
            model, cluster, workload, plans, memory_headroom=budget.memory_headroom, params=params,
            time_unfit=time_unfit,
        )  # fmt: skip
        return raw, raw if goodput is None else with_goodput(raw, model, cluster, precision, goodput)

    pruning = None
    if enumeration is None:
        found = expand_structures(
            model, cluster, workload, max_micro_batch, precision, engines=engines,
            quantized_collectives=quantized_collectives,
        )  # fmt: skip
        keep = None
        if prune:
            keep, pruning = _bounded(
                model, cluster, workload, budget, found, params, score, goodput, keep_top, max_micro_batch,
                precision,
            )  # fmt: skip
        enumeration = Enumeration(found.plans(keep), found.candidates, found.invalid_counts)
    raw, estimates = score(enumeration.plans)
    selection = select_plan(
        enumeration.plans,
        estimates,
        budget,
        tie_resolution(estimates.params, model, cluster, workload, enumeration.plans),
    )
    return Ranking(enumeration, estimates, selection, raw.hours, pruning)


def _bounded(
    model: ModelSpec,
    cluster: ClusterSpec,
    workload: Workload,
    budget: Budget,
    found: Expansions,
    params: ModelParams,
    score: Callable[[PlanTable], tuple[EstimateTable, EstimateTable]],
    goodput: GoodputSpec | None,
    keep_top: int,
    max_micro_batch: int,
    precision: Precision | Sequence[Precision],
) -> tuple[np.ndarray, Pruning | None]:
    """The structures a bounded ranking scores (`bound.prune_structures`), and what it skipped."""
    from service.costmodel.goodput import wall_hours
    from service.spec.production import checkpoint_bytes

    precisions = (precision,) if isinstance(precision, str) else tuple(precision)
    bound = structure_bound_s(model, cluster, workload, found.structures, max_micro_batch, precisions, params)

    def hours_of(hours: np.ndarray) -> np.ndarray:  # as `with_goodput` prices the run
        if goodput is None:
            return hours
        return wall_hours(hours, cluster.num_gpus, checkpoint_bytes(model, precision), goodput)  # type: ignore[arg-type]

    def feasible(keep: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        plans = found.plans(keep)
        est = score(plans)[1]
        resolution = tie_resolution(params, model, cluster, workload, plans)
        return objective_values(est, budget.objective), plan_statuses(est, budget) == SELECTED, resolution

    objective_of = partial(
        objective_of_step, objective=budget.objective, workload=workload, hours_of=hours_of
    )
    return prune_structures(found, bound, feasible, objective_of, keep_top)
