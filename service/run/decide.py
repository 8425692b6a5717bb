"""Scoring with goodput, selection across GPU types, and the min-max-regret choice the sensitivity
scenarios (service/run/sensitivity.py) feed.

`score` is the planner's pipeline (enumerate, `estimate_table` with a parameter set, `select_plan`)
with one change: hours and dollars are the expected wall-clock of the run, interruptions, checkpoints
and restarts included (service/run/goodput.py), so the budget is checked against what the run will
really cost. Selection stays the planner's pure function (service/plans/select.py).

The nominal choice is kept unless, in some scenario, it is more than `ROBUST_TOLERANCE` worse than
that scenario's best while another plan, within the tolerance of the nominal best, stays closer to
every scenario's best (min-max regret, `robust_choice`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from service.costmodel.result import EstimateTable
from service.plans.enumerate import DEFAULT_MAX_MICRO_BATCH, Enumeration, enumerate_plans
from service.plans.select import Selection, select_plan
from service.run.goodput import checkpoint_bytes, wall_hours
from service.spec.hardware import ClusterSpec
from service.spec.model import ModelSpec
from service.spec.params import ModelParams
from service.spec.production import GoodputSpec
from service.spec.workload import Budget, Workload

ROBUST_TOLERANCE = 0.05


@dataclass(frozen=True)
class Scored:
    """One cluster's ranking: hours/dollars (and their intervals) are goodput-adjusted wall-clock."""

    cluster: ClusterSpec
    enumeration: Enumeration
    est: EstimateTable
    hours_no_failures: np.ndarray
    selection: Selection

    @property
    def plans(self):  # type: ignore[no-untyped-def]
        return self.enumeration.plans

    def objective(self, objective: str) -> np.ndarray:
        """Lower is better: dollars (cost) or −tokens/s (throughput)."""
        return self.est.dollars if objective == "cost" else -self.est.tokens_per_s


def with_goodput(
    est: EstimateTable, model: ModelSpec, cluster: ClusterSpec, precision: str, goodput: GoodputSpec
) -> EstimateTable:
    """`est` with hours and dollars (and their intervals) scaled to the expected wall-clock."""
    ckpt = checkpoint_bytes(model, precision)
    wall = wall_hours(est.hours, cluster.num_gpus, ckpt, goodput)
    factor = np.where(est.hours > 0, wall / np.maximum(est.hours, 1e-12), 1.0)
    return replace(
        est,
        hours=est.hours * factor,
        dollars=est.dollars * factor,
        hours_low=est.hours_low * factor,
        hours_high=est.hours_high * factor,
        dollars_low=est.dollars_low * factor,
        dollars_high=est.dollars_high * factor,
    )


def score(
    model: ModelSpec,
    cluster: ClusterSpec,
    workload: Workload,
    budget: Budget,
    params: ModelParams,
    goodput: GoodputSpec,
    max_micro_batch: int = DEFAULT_MAX_MICRO_BATCH,
    precision: str = "bf16",
    enumeration: Enumeration | None = None,
    quantized_collectives: bool = False,
) -> Scored:
    from service.costmodel import estimate_table

    enum = enumeration or enumerate_plans(
        model,
        cluster,
        workload,
        max_micro_batch,
        precision,  # type: ignore[arg-type]
        quantized_collectives=quantized_collectives,
    )
    raw = estimate_table(
        model, cluster, workload, enum.plans, memory_headroom=budget.memory_headroom, params=params
    )
    est = with_goodput(raw, model, cluster, precision, goodput)
    selection = select_plan(enum.plans, est, budget, est.params.residuals.scatter)
    return Scored(cluster, enum, est, raw.hours, selection)


def regret(values: np.ndarray, best: float, objective: str) -> np.ndarray:
    """How much worse each value is than `best` (fraction; 0 = as good). Values: `Scored.objective`."""
    if objective == "cost":
        return values / best - 1.0
    return best / values - 1.0  # values are −tokens/s: the ratio of tokens/s


def robust_choice(
    nominal_row: int, values: np.ndarray, feasible: np.ndarray, worst: np.ndarray, objective: str
) -> int:
    """The nominal best, unless it is more than `ROBUST_TOLERANCE` off some scenario's best while a plan
    within the tolerance of it nominally stays closer to every scenario's best (min-max regret).

    `values`: the nominal objective (`Scored.objective`); `feasible`: meets the budget nominally;
    `worst`: each plan's largest regret over the scenarios (inf where it misses a scenario's budget).
    """
    near = feasible & (regret(values, float(values[nominal_row]), objective) <= ROBUST_TOLERANCE)
    candidates = np.flatnonzero(near)
    if not len(candidates) or worst[nominal_row] <= ROBUST_TOLERANCE:
        return nominal_row
    robust = int(candidates[np.argmin(worst[candidates])])
    return robust if worst[robust] < worst[nominal_row] else nominal_row


def best_cluster(scored: list[Scored], objective: str) -> int | None:
    """Index of the cluster whose selected plan is best by the objective; None when none selects one."""
    best, value = None, np.inf
    for i, s in enumerate(scored):
        row = s.selection.selected
        if row is None:
            continue
        v = float(s.objective(objective)[row])
        if v < value:
            best, value = i, v
    return best
