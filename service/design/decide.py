"""Scoring with goodput, selection across GPU types, and the min-max-regret choice the sensitivity
scenarios (service/design/sensitivity.py) feed.

`score` is the planner's one ranking (`planner.rank_plans`) with goodput: hours and dollars are the
expected wall-clock of the run, interruptions, checkpoints and restarts included
(service/costmodel/goodput.py), so the budget is checked against what the run will really cost.

The nominal choice is kept unless, in some scenario, it is more than `ROBUST_TOLERANCE` worse than
that scenario's best while another plan of its tie group, within the tolerance of the nominal best,
stays closer to every scenario's best (min-max regret, `robust_choice`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.costmodel.result import EstimateTable
from service.plans.enumerate import DEFAULT_MAX_MICRO_BATCH, Enumeration
from service.plans.select import Selection
from service.report.decision_records import OtherEngines
from service.spec.experiment import ExperimentSpec
from service.spec.hardware import ClusterSpec
from service.spec.model import ModelSpec
from service.spec.params import ModelParams
from service.spec.plan import Engine
from service.spec.production import GoodputSpec
from service.spec.workload import Budget, Workload

ROBUST_TOLERANCE = 0.05
# `run` ranks the plans it can prove on proxies and launch (its DeepSpeed config, `service train`);
# `service plan` ranks every engine the experiment lists.
LAUNCHED_ENGINES: tuple[Engine, ...] = ("deepspeed",)


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

    def regret_values(self, objective: str) -> np.ndarray:
        """What regrets compare on this cluster, lower is better: hours for cost (dollars are hours ×
        the cluster's price, so the ratios are the same, and still defined at a price of 0) or
        −tokens/s (throughput)."""
        return self.est.hours if objective == "cost" else -self.est.tokens_per_s


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
    engines: tuple[Engine, ...] = LAUNCHED_ENGINES,
) -> Scored:
    """`planner.rank_plans` with goodput, over `engines` (those `run` launches), for one cluster."""
    from service.planner import rank_plans

    ranking = rank_plans(
        model,
        cluster,
        workload,
        budget,
        max_micro_batch,
        precision,  # type: ignore[arg-type]
        params,
        engines,
        quantized_collectives,
        goodput=goodput,
        enumeration=enumeration,
        time_unfit=True,  # the memo prints a plan that does not fit beside the others, with its time
    )
    return Scored(
        cluster, ranking.enumeration, ranking.estimates, ranking.hours_no_failures, ranking.selection
    )


def regret(values: np.ndarray, best: float, objective: str) -> np.ndarray:
    """How much worse each value is than `best` (fraction; 0 = as good). Values: `Scored.regret_values`
    (hours for cost, −tokens/s for throughput)."""
    if objective == "cost":
        return values / best - 1.0
    return best / values - 1.0  # values are −tokens/s: the ratio of tokens/s


def robust_choice(
    nominal_row: int,
    values: np.ndarray,
    allowed: np.ndarray,
    worst: np.ndarray,
    objective: str,
    best: float,
) -> int:
    """The nominal choice, unless it is more than `ROBUST_TOLERANCE` off some scenario's best while an
    allowed plan within the tolerance of the nominal best (`best`) stays closer to every scenario's best
    (min-max regret).

    `values`: the nominal objective (`Scored.regret_values`); `allowed`: the plans that may replace the
    choice (the caller's: its tie group, no riskier); `worst`: each plan's largest regret over the
    scenarios (inf where it misses a scenario's budget).
    """
    near = allowed & (regret(values, best, objective) <= ROBUST_TOLERANCE)
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


def other_engines(
    spec: ExperimentSpec, params: ModelParams, cluster: ClusterSpec, chosen_tokens_per_s: float | None
) -> OtherEngines | None:
    """The best plan of the engines the experiment lists beyond those `run` launches, ranked the same
    way (goodput, budget), for the memo to name beside the choice; None when it lists no others."""
    others = tuple(e for e in spec.engines if e not in LAUNCHED_ENGINES)
    if not others:
        return None
    s = score(
        spec.model,
        cluster,
        spec.workload,
        spec.budget,
        params,
        spec.goodput,
        quantized_collectives=spec.quantized_collectives,
        engines=others,
    )
    row = s.selection.selected
    if row is None:
        return OtherEngines(engines=list(others), label=None)
    tokens = float(s.est.tokens_per_s[row])
    return OtherEngines(
        engines=list(others),
        label=s.plans.row(row).short(),
        tokens_per_s=tokens,
        hours=float(s.est.hours[row]),
        dollars=float(s.est.dollars[row]),
        over_chosen=tokens / chosen_tokens_per_s if chosen_tokens_per_s else None,
    )
