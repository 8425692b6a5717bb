"""Sensitivity that can change the decision: the levers that reorder plans, what would flip the choice,
and how far the run is from its budget.

Moving GPU efficiency, bandwidth or price by the same factor for every plan moves every plan together,
so the choice cannot change and the regret is 0 by construction. The scenarios here move what plans
depend on *differently*:

- **the network between nodes** per GPU (12.5 / 25 / 50 GB/s: 800 Gb/s, 1.6 Tb/s and 3.2 Tb/s per
  8-GPU node, what clouds sell): sharded data parallelism crosses it every micro-batch, tensor and
  pipeline parallelism inside a node do not;
- **a per-micro-step overhead** (framework hooks, Python, synchronisation) as large as the fitted
  per-step one: plans with many small micro-steps pay it most;
- **memory +15 %**: a plan near the limit no longer fits;
- **offload twice as slow** (half the host-to-device bandwidth and half the CPU Adam rate): only plans
  that offload pay it.

The nominal choice is kept unless, in some scenario, it is more than `ROBUST_TOLERANCE` worse than that
scenario's best while another plan within the tolerance of the nominal best stays closer to every
scenario's best (min-max regret, `decide.robust_choice`). "What would flip the decision": the
scenarios whose choice differs from the nominal one and, for a multi-node cluster, the highest
inter-node bandwidth at which the choice changes. The budget margin: the throughput below which the
chosen plan would break the budget.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from service.design.decide import ROBUST_TOLERANCE, Scored, regret, robust_choice, score
from service.plans.select import MEETS_BUDGET
from service.report.decision_records import Scenario, Sensitivity
from service.spec.hardware import ClusterSpec
from service.spec.model import ModelSpec
from service.spec.params import ModelParams
from service.spec.plan_table import PlanTable
from service.spec.production import GoodputSpec
from service.spec.workload import Budget, Workload

NETWORK_GB_PER_S = (12.5, 25.0, 50.0)  # per GPU: 800 Gb/s, 1.6 Tb/s, 3.2 Tb/s per 8-GPU node
MEMORY_SCALE = 1.15
OFFLOAD_SLOWDOWN = 2.0
# Where the choice would flip: bandwidths tried below the cluster's own, per GPU (GB/s).
FLIP_SEARCH_GB_PER_S = (100.0, 50.0, 25.0, 12.5, 6.25, 3.125, 1.5625)
FLIP_REFINE_STEPS = 4  # bisections of the halving step that flips: the flip point to within ~5 %


@dataclass(frozen=True)
class Lever:
    """One scenario: the cluster, parameters and budget it scores under."""

    name: str
    cluster: ClusterSpec
    params: ModelParams
    budget: Budget


def with_network(cluster: ClusterSpec, gb_per_s: float) -> ClusterSpec:
    """`cluster` with `gb_per_s` between nodes per GPU (its own field and the GPU spec the model reads)."""
    gpu = cluster.gpu.model_copy(update={"inter_node_bandwidth_gb_per_s": gb_per_s})
    return cluster.model_copy(update={"gpu": gpu, "inter_node_bandwidth_gb_per_s": gb_per_s})


def memory_scaled_budget(budget: Budget, scale: float) -> Budget:
    """A budget under which a plan fits only if `scale` × its memory fits the original limit:
    total·scale ≤ HBM·(1 − h)  ⇔  total ≤ HBM·(1 − h') with 1 − h' = (1 − h) / scale."""
    return budget.model_copy(update={"memory_headroom": 1.0 - (1.0 - budget.memory_headroom) / scale})


def levers(cluster: ClusterSpec, params: ModelParams, budget: Budget) -> Iterator[Lever]:
    """The scenarios, each moving one thing that plans depend on differently (module docstring)."""
    if cluster.num_nodes > 1:
        for bw in NETWORK_GB_PER_S:
            if bw != cluster.gpu.inter_node_bandwidth_gb_per_s:
                per_node = bw * 8 * cluster.gpus_per_node / 1000
                name = f"network {bw:g} GB/s per GPU ({per_node:g} Tb/s per node)"
                yield Lever(name, with_network(cluster, bw), params, budget)
    overhead = max(params["step_overhead_s"], 0.02)
    slow_steps = params.with_values({"microstep_overhead_s": params["microstep_overhead_s"] + overhead})
    yield Lever(f"+{overhead * 1e3:.0f} ms per micro-step", cluster, slow_steps, budget)
    yield Lever(
        f"memory +{MEMORY_SCALE - 1:.0%}", cluster, params, memory_scaled_budget(budget, MEMORY_SCALE)
    )
    gpu = cluster.gpu
    slow_host = gpu.model_copy(
        update={
            "host_to_device_gb_per_s": gpu.host_to_device_gb_per_s / OFFLOAD_SLOWDOWN,
            "cpu_adam_gparams_per_s": gpu.cpu_adam_gparams_per_s / OFFLOAD_SLOWDOWN,
        }
    )
    yield Lever(
        f"offload {OFFLOAD_SLOWDOWN:g}× slower", cluster.model_copy(update={"gpu": slow_host}), params, budget
    )


def _score(nominal: Scored, lever: Lever, model: ModelSpec, workload: Workload, goodput: GoodputSpec,
           precision: str) -> Scored:  # fmt: skip
    return score(
        model,
        lever.cluster,
        workload,
        lever.budget,
        lever.params,
        goodput,
        precision=precision,
        enumeration=nominal.enumeration,
    )


def sensitivity(
    nominal: Scored,
    model: ModelSpec,
    workload: Workload,
    budget: Budget,
    params: ModelParams,
    goodput: GoodputSpec,
    precision: str = "bf16",
) -> tuple[Sensitivity, int | None]:
    """The scenarios, the row chosen after them (the nominal choice, or a more robust one), what would
    flip the choice, and the budget margin. A scenario flips the choice when the chosen plan falls
    outside that scenario's tie group: more than the model's resolution behind its best, or out of
    budget."""
    nominal_row = nominal.selection.selected
    labels = nominal.plans
    objective = budget.objective
    tie_regret = nominal.selection.tie_regret
    feasible_nominal = np.isin(nominal.selection.status, MEETS_BUDGET)
    runs: list[tuple[Lever, Scored, np.ndarray]] = []
    worst = np.where(feasible_nominal, 0.0, np.inf)
    for lever in levers(nominal.cluster, params, budget):
        s = _score(nominal, lever, model, workload, goodput, precision)
        r = scenario_regret(s, objective)
        worst = np.maximum(worst, r)
        runs.append((lever, s, r))
    if nominal_row is None:
        note = "no plan meets the budget, so there is no choice to test"
        chosen = None
    else:
        # A more robust plan may replace the nominal choice, but not one riskier on what the tie rule
        # puts first (offload, open defects, memory margin): robustness to a scenario does not buy those.
        # Nor may it leave the tie group: outside it the model can tell the plans apart.
        in_group = np.isin(np.arange(len(labels)), nominal.selection.ties)
        allowed = feasible_nominal & in_group & ~_riskier(nominal, nominal_row)
        values = nominal.regret_values(objective)
        best = float(values[feasible_nominal].min())
        chosen = robust_choice(nominal_row, values, allowed, worst, objective, best)
        note = _robust_note(labels, nominal_row, chosen, worst)
    scenarios = [
        Scenario(
            name=lever.name,
            selected_label=labels.row(s.selection.selected).short()
            if s.selection.selected is not None
            else None,
            nominal_status=s.selection.status_name(chosen),
            nominal_regret=_chosen_regret(s, r, chosen),
            objective_value=_best_value(s, objective),
            nominal_value=None if chosen is None else abs(float(s.objective(objective)[chosen])),
        )
        for lever, s, r in runs
    ]
    broken = [sc.name for sc in scenarios if sc.selected_label is None]
    if broken:
        note += "; no plan meets the budget under: " + ", ".join(broken)
    flips = [] if chosen is None else [sc.name for sc in scenarios if sc.nominal_regret > tie_regret]
    chosen_label = labels.row(chosen).short() if chosen is not None else None
    return (
        Sensitivity(
            scenarios=scenarios,
            nominal_label=labels.row(nominal_row).short() if nominal_row is not None else None,
            chosen_label=chosen_label,
            flips=flips,
            note=note,
            flip=_flip_line(nominal, chosen, flips, model, workload, budget, params, goodput, precision),
            budget_margin=budget_margin(nominal, chosen, budget),
        ),
        chosen,
    )


def _riskier(s: Scored, row: int) -> np.ndarray:
    """Plans that offload more than `row`, use more features with open defects, or risk the memory
    limit where `row` does not."""
    risk = s.selection.risk
    if risk is None:
        return np.zeros(len(s.est), dtype=bool)
    bugs = risk.defect_count
    return (
        (risk.offloads > risk.offloads[row])
        | (bugs > bugs[row])
        | (risk.tight_memory & ~risk.tight_memory[row])
    )


def scenario_regret(s: Scored, objective: str) -> np.ndarray:
    """Each plan's regret against the scenario's best objective (inf where it misses the budget; 0 for
    every plan when none meets it: nothing to prefer, reported as a risk)."""
    feasible = np.isin(s.selection.status, MEETS_BUDGET)
    values = s.regret_values(objective)
    if not feasible.any():
        return np.zeros(len(values))
    # Against the best objective, not the scenario's choice, which may be a safer plan of its tie group.
    return np.where(feasible, regret(values, float(values[feasible].min()), objective), np.inf)


def _chosen_regret(s: Scored, r: np.ndarray, chosen: int | None) -> float:
    """The choice's regret in scenario `s`: infinite where it no longer meets the budget (or fits), even
    when no plan does there (`scenario_regret` leaves every plan at 0 then, nothing to prefer)."""
    if chosen is None:
        return float("nan")
    if s.selection.status[chosen] not in MEETS_BUDGET:
        return float("inf")
    return float(r[chosen])


def _best_value(s: Scored, objective: str) -> float | None:
    row = s.selection.selected
    return None if row is None else abs(float(s.objective(objective)[row]))


def _robust_note(labels: PlanTable, nominal_row: int, chosen: int, worst: np.ndarray) -> str:
    if chosen != nominal_row:
        nominal, robust = labels.row(nominal_row).short(), labels.row(chosen).short()
        return (
            f"the nominal choice, {nominal}, is up to {_pct(worst[nominal_row])} worse than a scenario's "
            f"best; {robust} is never more than {_pct(worst[chosen])} worse and within "
            f"{ROBUST_TOLERANCE:.0%} of the nominal best, so it is chosen"
        )
    if worst[nominal_row] <= ROBUST_TOLERANCE:
        return (
            f"the choice stays within {_pct(worst[nominal_row])} of every scenario's best plan "
            f"(tolerance {ROBUST_TOLERANCE:.0%}): kept"
        )
    return (
        f"the choice is up to {_pct(worst[nominal_row])} behind a scenario's best plan; kept, because no "
        f"other plan that is as safe (no more offload, open defects or memory risk) and within "
        f"{ROBUST_TOLERANCE:.0%} of it nominally has a smaller worst case over the scenarios"
    )


def _flip_line(
    nominal: Scored,
    chosen: int | None,
    flips: list[str],
    model: ModelSpec,
    workload: Workload,
    budget: Budget,
    params: ModelParams,
    goodput: GoodputSpec,
    precision: str,
) -> str:
    """What would flip the decision, in one line: the scenarios that do, and the highest inter-node
    bandwidth below the cluster's at which the choice leaves the tie group of the best plan."""
    if chosen is None:
        return ""
    parts = [f"the choice leaves the best plan's tie group under: {', '.join(flips)}"] if flips else []
    cluster = nominal.cluster
    tie_regret = nominal.selection.tie_regret
    if cluster.num_nodes > 1:
        own = cluster.gpu.inter_node_bandwidth_gb_per_s

        def regret_at(bw: float) -> tuple[Scored, np.ndarray]:
            lever = Lever("", with_network(cluster, bw), params, budget)
            s = _score(nominal, lever, model, workload, goodput, precision)
            return s, scenario_regret(s, budget.objective)

        above = own
        for bw in (b for b in FLIP_SEARCH_GB_PER_S if b < own):
            s, r = regret_at(bw)
            if r[chosen] > tie_regret:
                # Bisect (geometrically) between the halving grid's last kept and first flipped bandwidth.
                low, high = bw, above
                for _ in range(FLIP_REFINE_STEPS):
                    mid = math.sqrt(low * high)
                    s_mid, r_mid = regret_at(mid)
                    if r_mid[chosen] > tie_regret:
                        low, s, r = mid, s_mid, r_mid
                    else:
                        high = mid
                best = s.selection.selected
                then = (
                    f"{nominal.plans.row(best).short()} becomes the choice"
                    if best is not None
                    else ("no plan meets the budget")
                )
                behind = "misses the budget" if not np.isfinite(r[chosen]) else f"is {r[chosen]:.0%} behind"
                parts.append(
                    f"it flips below about {high:.3g} GB/s per GPU between nodes (of {own:g} assumed): at "
                    f"{low:.3g} it {behind} and {then}"
                )
                break
            above = bw
        else:
            lowest = FLIP_SEARCH_GB_PER_S[-1]
            parts.append(f"no inter-node bandwidth down to {lowest:g} GB/s per GPU changes it")
    return "; ".join(parts) if parts else "no scenario changes the choice"


def budget_margin(nominal: Scored, row: int | None, budget: Budget) -> str:
    """The throughput below which `row` would break max_dollars or max_hours (hours and dollars scale as
    1 / tokens/s for a fixed token count, goodput factor held)."""
    if row is None:
        return ""
    est = nominal.est
    tokens = float(est.tokens_per_s[row])
    floors = []
    if budget.max_dollars is not None:
        floors.append((tokens * float(est.dollars[row]) / budget.max_dollars, "max_dollars"))
    if budget.max_hours is not None:
        floors.append((tokens * float(est.hours[row]) / budget.max_hours, "max_hours"))
    if not floors:
        return "no budget set: no throughput breaks it"
    floor, which = max(floors)
    low = float(est.tokens_per_s_low[row])
    return (
        f"over budget ({which}) only below {floor:,.0f} tokens/s, {floor / tokens:.0%} of the prediction "
        f"{tokens:,.0f} (its 80 % interval starts at {low:,.0f})"
    )


def _pct(x: float) -> str:
    return "∞ (misses the budget)" if not np.isfinite(x) else f"{x:.1%}"
