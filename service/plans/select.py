"""Selection under a budget: the best plan that fits, meets max_dollars and max_hours, and why every
other plan lost.

A pure function of the scored table and the `Budget`. Each scored plan gets one status, checked in
this order: `over memory` (does not fit with the budget's headroom), `over budget` (dollars >
max_dollars), `over deadline` (hours > max_hours); of the plans that pass all three, the best by the
objective is `selected` and the others are `slower` (fewer tokens/s) or `costlier` (more dollars),
or `tied`.

Ties are ties: the cost model cannot order plans whose objective differs by less than its resolution
(`resolution`, a log ratio: the parameter set's offset-free scatter of out-of-sample errors,
`Residuals.scatter`). Every feasible plan within it of the objective's best is in the tie group, and
the group goes to its lowest-risk plan (plans/risk.py: no offload, memory margin, fewest moving parts,
then the objective); the others in the group are `riskier` (they lose on a named risk) or `tied` (as
safe, behind or equal on the objective), and `Selection.tie_note` says why the choice won. With no
resolution (0) only exact ties are ties, and fewer offloads win them.

When no plan passes, the answer names the binding constraint and offers a fallback: the cheapest plan
that meets the deadline, or the fastest plan when none does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from service.costmodel.result import EstimateTable
from service.plans.risk import Risk, risk_of
from service.spec.hardware import ClusterSpec
from service.spec.model import ModelSpec
from service.spec.params import ModelParams
from service.spec.plan_table import PlanTable
from service.spec.units import GIB
from service.spec.workload import Budget, Workload

STATUSES: tuple[str, ...] = (
    "selected", "over memory", "over budget", "over deadline", "slower", "costlier", "tied", "riskier"
)  # fmt: skip
SELECTED, OVER_MEMORY, OVER_BUDGET, OVER_DEADLINE, SLOWER, COSTLIER, TIED, RISKIER = range(len(STATUSES))
# The statuses of plans that fit in memory and meet the budget (the rest lost to memory or budget).
MEETS_BUDGET = (SELECTED, SLOWER, COSTLIER, TIED, RISKIER)


@dataclass(frozen=True)
class Selection:
    """Row indexes into the scored table, and a status per row (index into STATUSES).

    `order` holds every plan that fits in memory: those meeting the budget first, then the others,
    each group best objective first. `binding` is None when a plan was selected, else "no valid plan",
    "memory", "max_dollars", "max_hours" or "max_hours and max_dollars".
    """

    selected: int | None
    order: np.ndarray
    status: np.ndarray
    binding: str | None
    fallback: int | None
    message: str
    ties: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # the group, choice first
    resolution: float = 0.0  # log ratio within which plans tie
    tie_note: str = ""
    risk: Risk | None = None

    @property
    def tie_regret(self) -> float:
        """The tie group's width as a regret (how much worse than the best a plan may be, a fraction):
        `resolution` is a log ratio, so e^resolution − 1."""
        return math.expm1(self.resolution)

    def status_name(self, row: int | None) -> str:
        return "-" if row is None else STATUSES[self.status[row]]

    def counts(self) -> dict[str, int]:
        """{status: plans} for every losing status (zeros included, so the keys are stable)."""
        n = np.bincount(self.status, minlength=len(STATUSES))
        return {STATUSES[s]: int(n[s]) for s in range(len(STATUSES)) if s != SELECTED}


def objective_order(
    est: EstimateTable, rows: np.ndarray, objective: str, offloads: np.ndarray | None = None
) -> np.ndarray:
    """`rows` best first: most tokens/s (ties: fewer dollars), or fewest dollars (ties: more tokens/s);
    remaining ties: fewer `offloads` (per row of the table), then table order."""
    tokens, dollars = est.tokens_per_s[rows], est.dollars[rows]
    last = offloads[rows] if offloads is not None else np.zeros(len(rows))
    keys = (last, dollars, -tokens) if objective == "throughput" else (last, -tokens, dollars)
    return rows[np.lexsort(keys)]  # np.lexsort sorts by the last key first; it is stable


def plan_statuses(est: EstimateTable, budget: Budget) -> np.ndarray:
    """Per plan: over memory, over budget, over deadline, or SELECTED (fits and meets the budget)."""
    no_limit = np.inf
    over_dollars = est.dollars > (budget.max_dollars if budget.max_dollars is not None else no_limit)
    over_hours = est.hours > (budget.max_hours if budget.max_hours is not None else no_limit)
    return np.select(
        [~est.fits.astype(bool), over_dollars, over_hours],
        [OVER_MEMORY, OVER_BUDGET, OVER_DEADLINE],
        default=SELECTED,  # provisional: every plan that meets the budget, until one is picked
    ).astype(np.int8)


def objective_values(est: EstimateTable, objective: str) -> np.ndarray:
    """What the objective compares as a ratio, larger is worse: hours (cost: on one cluster dollars are
    hours × its price, the same ratios, and still defined when the price is 0) or 1 / tokens/s
    (throughput)."""
    return est.hours if objective == "cost" else 1.0 / np.maximum(est.tokens_per_s, 1e-300)


def tie_resolution(
    params: ModelParams, model: ModelSpec, cluster: ClusterSpec, workload: Workload, plans: PlanTable
) -> np.ndarray:
    """Per plan, the log ratio within which plans tie with it: the set's offset-free scatter (how far two
    runs of one stack are mispredicted relative to each other), widened as the plan's interval is for a
    software stack the fit never saw on this GPU (`ModelParams.stack_widening`): nothing measured the
    relative error of that stack's plans."""
    from service.spec.stack import plan_stacks

    legacy = workload.zero3_collectives == "per_tensor_lists"
    stacks = plan_stacks(plans, legacy, model.moe is not None) if params.domain.stacks else None
    widening = 1.0 + np.asarray(params.stack_widening(stacks, cluster.gpu.name), dtype=float)
    return np.broadcast_to(params.residuals.scatter * widening, (len(plans),))


def tie_group(est: EstimateTable, feasible: np.ndarray, objective: str, resolution: float) -> np.ndarray:
    """The feasible rows (best objective first) within `resolution` (log ratio) of the best."""
    if len(feasible) == 0:
        return feasible
    values = objective_values(est, objective)[feasible]
    within = (np.log(values / values[0]) <= resolution) if resolution > 0 else np.zeros(len(values), bool)
    exact = (est.tokens_per_s[feasible] == est.tokens_per_s[feasible[0]]) & (
        est.dollars[feasible] == est.dollars[feasible[0]]
    )
    return feasible[within | exact]


def select_plan(
    plans: PlanTable, est: EstimateTable, budget: Budget, resolution: float | np.ndarray = 0.0
) -> Selection:
    """The lowest-risk plan among those within `resolution` of the best `budget.objective` that fit and
    meet the budget (the best itself when `resolution` is 0 and nothing ties it exactly). `resolution`:
    one log ratio, or one per plan (`tie_resolution`), of which the best plan's applies."""
    status = plan_statuses(est, budget)
    rows = np.arange(len(est))
    risk = risk_of(plans, est)
    feasible = objective_order(est, rows[status == SELECTED], budget.objective, risk.offloads)
    per_plan = np.asarray(resolution, dtype=float)
    if per_plan.ndim == 0:
        resolution = float(per_plan)
    else:
        resolution = float(per_plan[feasible[0]]) if len(feasible) else float(per_plan.max(initial=0.0))
    over = (status == OVER_BUDGET) | (status == OVER_DEADLINE)
    others = objective_order(est, rows[over], budget.objective, risk.offloads)
    if len(feasible) == 0:
        order = np.concatenate([feasible, others])
        binding, fallback, message = _explain_none(plans, est, budget, status)
        return Selection(None, order, status, binding, fallback, message, resolution=resolution, risk=risk)
    group = risk.order(tie_group(est, feasible, budget.objective, resolution))
    best = int(group[0])
    rest = feasible[~np.isin(feasible, group)]
    order = np.concatenate([group, rest, others])
    losers = rest
    slower = est.tokens_per_s[losers] < est.tokens_per_s[best]
    costlier = est.dollars[losers] > est.dollars[best]
    first, second = (slower, costlier) if budget.objective == "throughput" else (costlier, slower)
    code_first, code_second = (SLOWER, COSTLIER) if budget.objective == "throughput" else (COSTLIER, SLOWER)
    status[losers] = np.select([first, second], [code_first, code_second], default=TIED)
    riskier = risk.riskier_than(best)[group[1:]]
    status[group[1:]] = np.where(riskier, RISKIER, TIED)
    message = (
        f"selected {plans.row(best).short()} by {budget.objective}: {_numbers(est, best)}; "
        f"{len(feasible)} of {len(order)} plans that fit in memory meet the budget"
    )
    note = _tie_note(plans, est, budget.objective, group, int(feasible[0]), risk, resolution)
    return Selection(best, order, status, None, None, message, group, resolution, note, risk)


def _tie_note(
    plans: PlanTable,
    est: EstimateTable,
    objective: str,
    group: np.ndarray,
    objective_best: int,
    risk: Risk,
    resolution: float,
) -> str:
    """Why the choice won its tie group, in one paragraph (empty when nothing ties it)."""
    if len(group) < 2:
        return ""
    chosen = int(group[0])
    label = plans.row(chosen).short()
    size = (
        f"{len(group)} plans lie within the model's resolution of the best {objective} "
        f"(±{np.expm1(resolution):.1%}: how far two runs of one software stack are mispredicted relative "
        "to each other, the spread of its out-of-sample errors about each source's own bias, widened as the "
        "interval is where the fit never saw the stack), so the model cannot order them"
        if resolution > 0
        else f"{len(group)} plans tie exactly"
    )
    values = objective_values(est, objective)
    if chosen == objective_best:
        runner = int(group[1])
        reasons = risk.why_riskier(runner, chosen) or ["the best objective of equally risky plans"]
        return (
            f"{size}. {label} is both the model's best and the lowest-risk among them; the next, "
            f"{plans.row(runner).short()}: {'; '.join(reasons)}."
        )
    gap = values[chosen] / values[objective_best] - 1.0
    reasons = risk.why_riskier(objective_best, chosen)
    return (
        f"{size}. {label} wins the tie over the model's nominal best, {plans.row(objective_best).short()} "
        f"({gap:.1%} better on paper, inside the resolution), because that plan "
        f"{'; '.join(reasons) or 'is no safer'}. A short A/B of the two on the cluster in the first hour "
        "(the same steps timed for each) is what separates them."
    )


def _numbers(est: EstimateTable, i: int) -> str:
    return (
        f"{est.tokens_per_s[i]:,.0f} tokens/s, {est.hours[i]:,.1f} h, ${est.dollars[i]:,.0f}, "
        f"{est.total_bytes[i] / GIB:.1f} GiB per GPU"
    )


def _explain_none(
    plans: PlanTable, est: EstimateTable, budget: Budget, status: np.ndarray
) -> tuple[str, int | None, str]:
    """(binding constraint, fallback row, message) when no plan meets everything."""
    if len(est) == 0:
        return "no valid plan", None, "no valid plan: no candidate passes the plan rules for this cluster"
    fitting = np.flatnonzero(status != OVER_MEMORY)
    if len(fitting) == 0:
        smallest = int(np.argmin(est.total_bytes))
        return (
            "memory",
            None,
            (
                f"no plan fits in GPU memory: the smallest, {plans.row(smallest).short()}, needs "
                f"{est.total_bytes[smallest] / GIB:.1f} GiB per GPU; the limit after headroom is "
                f"{est.memory_limit_bytes[smallest] / GIB:.1f} GiB"
            ),
        )
    in_time = fitting if budget.max_hours is None else fitting[est.hours[fitting] <= budget.max_hours]
    if len(in_time):
        cheapest = int(objective_order(est, in_time, "cost")[0])
        deadline = "" if budget.max_hours is None else f" that finishes within {budget.max_hours:g} h"
        return (
            "max_dollars",
            cheapest,
            (
                f"no plan meets the budget: max_dollars binds. Every plan that fits{deadline} costs more "
                f"than ${budget.max_dollars:,.0f}; the cheapest, {plans.row(cheapest).short()}, would take "
                f"{_numbers(est, cheapest)}"
            ),
        )
    fastest = int(objective_order(est, fitting, "throughput")[0])
    within_dollars = budget.max_dollars is None or bool(np.any(est.dollars[fitting] <= budget.max_dollars))
    binding = "max_hours" if within_dollars else "max_hours and max_dollars"
    also = "" if within_dollars else f", and every plan costs more than ${budget.max_dollars:,.0f}"
    return (
        binding,
        fastest,
        (
            f"no plan meets the budget: {binding} {'binds' if within_dollars else 'bind'}. "
            f"No plan that fits finishes within "
            f"{budget.max_hours:g} h{also}; the fastest, {plans.row(fastest).short()}, would take "
            f"{_numbers(est, fastest)}"
        ),
    )
