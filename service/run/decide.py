"""Scoring with goodput, selection across GPU types, and the ±20 % sensitivity of the choice.

`score` is the planner's pipeline (enumerate, `estimate_table` with a parameter set, `select_plan`)
with one change: hours and dollars are the expected wall-clock of the run, interruptions, checkpoints
and restarts included (service/run/goodput.py), so the budget is checked against what the run will
really cost. Selection stays the planner's pure function (service/plans/select.py).

Sensitivity: the ranking is recomputed with GPU efficiency, network bandwidth and price each moved
by ±20 %. The nominal choice is kept unless, in some scenario, it is more than `ROBUST_TOLERANCE`
worse than that scenario's best while another plan, within the tolerance of the nominal best, stays
closer to every scenario's best (min-max regret).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from service.costmodel.result import EstimateTable
from service.plans.enumerate import DEFAULT_MAX_MICRO_BATCH, Enumeration, enumerate_plans
from service.plans.select import COSTLIER, SELECTED, SLOWER, STATUSES, TIED, Selection, select_plan
from service.report.result import Scenario, Sensitivity
from service.run.goodput import checkpoint_bytes, wall_hours
from service.spec.hardware import ClusterSpec
from service.spec.model import ModelSpec
from service.spec.params import ModelParams
from service.spec.production import GoodputSpec
from service.spec.workload import Budget, Workload

ROBUST_TOLERANCE = 0.05
PERTURBATION = 0.20
FEASIBLE = (SELECTED, COSTLIER, SLOWER, TIED)


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
    return Scored(cluster, enum, est, raw.hours, select_plan(enum.plans, est, budget))


def perturbed_clusters(cluster: ClusterSpec) -> list[tuple[str, ClusterSpec]]:
    """(scenario name, cluster) for efficiency, bandwidth and price each at ±20 %."""
    gpu, out = cluster.gpu, []
    for sign, word in ((-1, "−"), (1, "+")):
        f = 1.0 + sign * PERTURBATION
        eff = gpu.model_copy(
            update={
                "gemm_efficiency_max": min(1.0, gpu.gemm_efficiency_max * f),
                "attention_efficiency": min(1.0, gpu.attention_efficiency * f),
            }
        )
        bw = gpu.model_copy(
            update={
                "intra_node_bandwidth_gb_per_s": gpu.intra_node_bandwidth_gb_per_s * f,
                "inter_node_bandwidth_gb_per_s": gpu.inter_node_bandwidth_gb_per_s * f,
            }
        )
        out.append((f"GPU efficiency {word}20 %", cluster.model_copy(update={"gpu": eff})))
        # A cluster's own network (inter_node_bandwidth_gb_per_s) moves with it, or re-validating the
        # scenario would put the unmoved figure back into the GPU spec.
        own = cluster.inter_node_bandwidth_gb_per_s
        network = {"gpu": bw, "inter_node_bandwidth_gb_per_s": None if own is None else own * f}
        out.append((f"network bandwidth {word}20 %", cluster.model_copy(update=network)))
        price = cluster.price_usd_per_gpu_hour * f
        out.append((f"price {word}20 %", cluster.model_copy(update={"price_per_gpu_hour_usd": price})))
    return out


def regret(values: np.ndarray, best: float, objective: str) -> np.ndarray:
    """How much worse each value is than `best` (fraction; 0 = as good). Values: `Scored.objective`."""
    if objective == "cost":
        return values / best - 1.0
    return best / values - 1.0  # values are −tokens/s: the ratio of tokens/s


def sensitivity(
    nominal: Scored,
    model: ModelSpec,
    workload: Workload,
    budget: Budget,
    params: ModelParams,
    goodput: GoodputSpec,
    precision: str = "bf16",
) -> tuple[Sensitivity, int | None]:
    """The scenarios, and the row chosen after them (the nominal choice, or a more robust one)."""
    nominal_row = nominal.selection.selected
    labels = nominal.plans
    objective = budget.objective
    feasible_nominal = np.isin(nominal.selection.status, FEASIBLE)
    scenarios: list[Scenario] = []
    worst = np.where(feasible_nominal, 0.0, np.inf)
    for name, cluster in perturbed_clusters(nominal.cluster):
        s = score(
            model,
            cluster,
            workload,
            budget,
            params,
            goodput,
            precision=precision,
            enumeration=nominal.enumeration,
        )
        best = s.selection.selected
        values = s.objective(objective)
        if best is None:  # no plan meets the budget here: nothing to prefer (a risk, reported)
            r = np.zeros(len(values))
        else:
            r = regret(values, float(values[best]), objective)
            r = np.where(np.isin(s.selection.status, FEASIBLE), r, np.inf)
        worst = np.maximum(worst, r)
        scenarios.append(
            Scenario(
                name=name,
                selected_label=labels.row(best).short() if best is not None else None,
                nominal_status=STATUSES[s.selection.status[nominal_row]] if nominal_row is not None else "-",
                nominal_regret=float(r[nominal_row]) if nominal_row is not None else float("nan"),
                objective_value=None if best is None else abs(float(values[best])),
            )
        )
    chosen = nominal_row
    note = "no plan meets the budget, so there is no choice to test"
    if nominal_row is not None:
        values = nominal.objective(objective)
        chosen = robust_choice(nominal_row, values, feasible_nominal, worst, objective)
        if chosen != nominal_row:
            note = (
                f"the nominal best, {labels.row(nominal_row).short()}, is up to "
                f"{_pct(worst[nominal_row])} worse than a scenario's best; "
                f"{labels.row(chosen).short()} is never more than {_pct(worst[chosen])} worse and within "
                f"{ROBUST_TOLERANCE:.0%} of the nominal best, so it is chosen"
            )
        else:
            note = (
                f"the choice stays within {_pct(worst[nominal_row])} of every scenario's best plan "
                f"(tolerance {ROBUST_TOLERANCE:.0%}): kept"
            )
    broken = [s.name for s in scenarios if s.selected_label is None]
    if broken:
        note += "; no plan meets the budget under: " + ", ".join(broken)
    flips = [
        s.name
        for s in scenarios
        if s.selected_label != (labels.row(chosen).short() if chosen is not None else None)
    ]
    return (
        Sensitivity(
            scenarios=scenarios,
            nominal_label=labels.row(nominal_row).short() if nominal_row is not None else None,
            chosen_label=labels.row(chosen).short() if chosen is not None else None,
            flips=flips,
            note=note,
        ),
        chosen,
    )


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


def _pct(x: float) -> str:
    return "∞ (misses the budget)" if not np.isfinite(x) else f"{x:.1%}"


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
