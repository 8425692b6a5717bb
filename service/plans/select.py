"""Selection under a budget: the best plan that fits, meets max_dollars and max_hours, and why every
other plan lost.

A pure function of the scored table and the `Budget`. Each scored plan gets one status, checked in
this order: `over memory` (does not fit with the budget's headroom), `over budget` (dollars >
max_dollars), `over deadline` (hours > max_hours); of the plans that pass all three, the best by the
objective is `selected` and the others are `slower` (fewer tokens/s) or `costlier` (more dollars),
or `tied` (same tokens/s and dollars: fewer offloads win, as they need less host memory and PCIe).
When no plan passes, the answer names the binding constraint and offers a fallback: the cheapest plan
that meets the deadline, or the fastest plan when none does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.costmodel.result import EstimateTable
from service.spec.plan_table import PlanTable
from service.spec.workload import Budget

STATUSES: tuple[str, ...] = (
    "selected", "over memory", "over budget", "over deadline", "slower", "costlier", "tied"
)  # fmt: skip
SELECTED, OVER_MEMORY, OVER_BUDGET, OVER_DEADLINE, SLOWER, COSTLIER, TIED = range(len(STATUSES))
GIB = 1024**3


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


def _statuses(est: EstimateTable, budget: Budget) -> np.ndarray:
    no_limit = np.inf
    over_dollars = est.dollars > (budget.max_dollars if budget.max_dollars is not None else no_limit)
    over_hours = est.hours > (budget.max_hours if budget.max_hours is not None else no_limit)
    return np.select(
        [~est.fits.astype(bool), over_dollars, over_hours],
        [OVER_MEMORY, OVER_BUDGET, OVER_DEADLINE],
        default=SELECTED,  # provisional: every plan that meets the budget, until one is picked
    ).astype(np.int8)


def select_plan(plans: PlanTable, est: EstimateTable, budget: Budget) -> Selection:
    """The plan with the best `budget.objective` among those that fit and meet the budget."""
    status = _statuses(est, budget)
    rows = np.arange(len(est))
    offloads = plans.offload_params.astype(np.int64) + plans.offload_optimizer
    feasible = objective_order(est, rows[status == SELECTED], budget.objective, offloads)
    over = (status == OVER_BUDGET) | (status == OVER_DEADLINE)
    others = objective_order(est, rows[over], budget.objective, offloads)
    order = np.concatenate([feasible, others])
    if len(feasible) == 0:
        binding, fallback, message = _explain_none(plans, est, budget, status)
        return Selection(None, order, status, binding, fallback, message)
    best = int(feasible[0])
    losers = feasible[1:]
    slower = est.tokens_per_s[losers] < est.tokens_per_s[best]
    costlier = est.dollars[losers] > est.dollars[best]
    first, second = (slower, costlier) if budget.objective == "throughput" else (costlier, slower)
    code_first, code_second = (SLOWER, COSTLIER) if budget.objective == "throughput" else (COSTLIER, SLOWER)
    status[losers] = np.select([first, second], [code_first, code_second], default=TIED)
    message = (
        f"selected {plans.row(best).short()} by {budget.objective}: {_numbers(est, best)}; "
        f"{len(feasible)} of {len(order)} plans that fit in memory meet the budget"
    )
    return Selection(best, order, status, None, fallback=None, message=message)


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
