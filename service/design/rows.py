"""The plans a memo shows, as `PlanRow`s: the choice, runners-up, the validated plans, the best of
every family, the cost-throughput Pareto front, and the best plan turned away by each constraint —
each with its numbers, intervals and why it lost."""

from __future__ import annotations

import numpy as np

from service.design.decide import Scored
from service.design.validate import FAMILIES, families_of
from service.plans.select import GIB, MEETS_BUDGET, OVER_BUDGET, OVER_DEADLINE, OVER_MEMORY, STATUSES
from service.report.result import CALIBRATED, MEMORY_FALLBACK, PRIOR, Interval, PlanRow
from service.spec.workload import Budget

RUNNERS_UP = 5
STATE_TERMS = ("params", "grads", "optimizer")


def memory_spread_bytes(s: Scored, memory_errors: tuple[float, float], widening: float) -> np.ndarray:
    """Half-width of every plan's memory interval: widening × (e_act · (activations + logits) + e_state ·
    model state), the rule the memo states under Extrapolation distance (service/design/calibration.py)."""
    est = s.est
    e_act, e_state = memory_errors
    act = est.activations_bytes + est.logits_bytes
    state = sum(getattr(est, f"{t}_bytes") for t in STATE_TERMS)
    return np.asarray(widening * (e_act * act + e_state * state), dtype=float)


def memory_fallback(s: Scored, chosen: int | None, spread: np.ndarray) -> int | None:
    """Plan B for a choice whose memory interval reaches past the limit: the best plan that meets the
    budget and stays under the limit even at its interval's high end. None when the choice itself does,
    or when no such plan exists. An out-of-memory error shows on the first steps, so the memo names
    this plan in advance instead of trading the choice's cost for a risk that costs minutes to test."""
    if chosen is None:
        return None
    high = s.est.total_bytes + spread
    limit = s.est.memory_limit_bytes
    if high[chosen] <= limit[chosen]:
        return None
    status = s.selection.status
    return next(
        (
            int(r)
            for r in s.selection.order
            if r != chosen and status[r] in MEETS_BUDGET and high[r] <= limit[r]
        ),
        None,
    )


def pareto_front(s: Scored) -> list[int]:
    """Rows that fit in memory and that no other such row beats on both dollars and tokens/s."""
    fits = np.flatnonzero(s.est.fits.astype(bool))
    order = fits[np.lexsort((-s.est.tokens_per_s[fits], s.est.dollars[fits]))]
    front, best_tokens = [], -np.inf
    for r in order:
        if s.est.tokens_per_s[r] > best_tokens:
            front.append(int(r))
            best_tokens = s.est.tokens_per_s[r]
    return front


def why(s: Scored, row: int, chosen: int | None, budget: Budget, status: str) -> str:
    est, plans = s.est, s.plans
    if status == "selected":
        return f"lowest risk of the plans tied for the best {budget.objective} (see Ties and Sensitivity)"
    if status in ("tied", "riskier") and chosen is not None:
        return _tied_why(s, row, chosen, budget)
    if status == "over memory":
        need, limit = est.total_bytes[row] / GIB, est.memory_limit_bytes[row] / GIB
        return f"needs {need:.1f} GiB per GPU; the limit is {limit:.1f} GiB"
    if status in ("over budget", "over deadline"):
        parts = []
        if budget.max_dollars is not None and est.dollars[row] > budget.max_dollars:
            parts.append(f"${est.dollars[row]:,.0f} > max ${budget.max_dollars:,.0f}")
        if budget.max_hours is not None and est.hours[row] > budget.max_hours:
            parts.append(f"{est.hours[row]:,.1f} h > max {budget.max_hours:g} h")
        return "; ".join(parts)
    if chosen is None:
        return status
    label = plans.row(chosen).short()
    if status == MEMORY_FALLBACK:
        return f"plan B if {label} runs out of memory: under the limit even at its interval's high end; " + (
            f"${est.dollars[row]:,.0f} vs ${est.dollars[chosen]:,.0f}"
            if budget.objective == "cost"
            else f"{est.tokens_per_s[row]:,.0f} tokens/s vs {est.tokens_per_s[chosen]:,.0f}"
        )
    if status == "less robust":
        return f"the nominal choice, but less robust than {label} under the sensitivity scenarios"
    if budget.objective == "cost":
        return f"${est.dollars[row]:,.0f} vs ${est.dollars[chosen]:,.0f} for {label}"
    return f"{est.tokens_per_s[row]:,.0f} tokens/s vs {est.tokens_per_s[chosen]:,.0f} for {label}"


def _tied_why(s: Scored, row: int, chosen: int, budget: Budget) -> str:
    """A tied plan: inside the model's resolution of the choice; what makes it riskier, if anything."""
    est, label = s.est, s.plans.row(chosen).short()
    if budget.objective == "cost":
        gap = f"${est.dollars[row]:,.0f} vs ${est.dollars[chosen]:,.0f}"
    else:
        gap = f"{est.tokens_per_s[row]:,.0f} vs {est.tokens_per_s[chosen]:,.0f} tokens/s"
    risk = s.selection.risk
    reasons = risk.why_riskier(row, chosen) if risk is not None else []
    tail = "; ".join(reasons) if reasons else "as safe; the choice is ahead on the objective or equal"
    return f"tied with {label} ({gap}, inside the model's resolution): {tail}"


def plan_row(
    s: Scored,
    row: int,
    status: str,
    reason: str,
    spread_bytes: float,
    calibrated: bool,
    validated: set[str],
    time_tag: str = PRIOR,
) -> PlanRow:
    est, plan = s.est, s.plans.row(row)
    total = float(est.total_bytes[row])
    mem_tag = CALIBRATED if calibrated else PRIOR
    rank_hits = np.flatnonzero(s.selection.order == row)
    return PlanRow(
        label=plan.short(),
        plan=plan,
        gpu=s.cluster.gpu.name,
        num_gpus=s.cluster.num_gpus,
        rank=int(rank_hits[0]) + 1 if len(rank_hits) else None,
        status=status,
        why=reason,
        families=families_of(plan),
        validated=plan.short() in validated,
        tokens_per_s=Interval(
            value=float(est.tokens_per_s[row]),
            low=float(est.tokens_per_s_low[row]),
            high=float(est.tokens_per_s_high[row]),
            tag=time_tag,
        ),
        hours=Interval(
            value=float(est.hours[row]),
            low=float(est.hours_low[row]),
            high=float(est.hours_high[row]),
            tag=time_tag,
        ),
        dollars=Interval(
            value=float(est.dollars[row]),
            low=float(est.dollars_low[row]),
            high=float(est.dollars_high[row]),
            tag=time_tag,
        ),
        hours_no_failures=float(s.hours_no_failures[row]),
        memory_per_gpu_bytes=Interval(
            value=total, low=max(0.0, total - spread_bytes), high=total + spread_bytes, tag=mem_tag
        ),
        memory_limit_bytes=float(est.memory_limit_bytes[row]),
        hbm_bytes=float(s.cluster.gpu.hbm_gib * GIB),
        memory_breakdown={
            **{
                t: float(getattr(est, f"{t}_bytes")[row])
                for t in (*STATE_TERMS, "activations", "logits", "buffers", "overhead")
            },
            "cpu_offload": float(est.cpu_offload_bytes[row]),
        },
        mfu=float(est.mfu[row]),
    )


def memo_rows(
    s: Scored,
    chosen: int | None,
    nominal: int | None,
    budget: Budget,
    memory_errors: tuple[float, float],
    widening: float,
    calibrated: bool,
    validated: set[str],
    time_tag: str = PRIOR,
) -> list[PlanRow]:
    """The rows the memo shows, chosen first, each once."""
    status = s.selection.status
    order = [int(r) for r in s.selection.order]
    feasible = [r for r in order if status[r] in MEETS_BUDGET]
    picks: list[int] = [] if chosen is None else [chosen]
    spread = memory_spread_bytes(s, memory_errors, widening)  # every plan's, once
    fallback = memory_fallback(s, chosen, spread)
    if fallback is not None:
        picks.append(fallback)
    if nominal is not None and nominal != chosen:
        picks.append(nominal)
    picks += [r for r in feasible if r != chosen][:RUNNERS_UP]
    picks += [r for r in order if s.plans.row(r).short() in validated]
    for _, test in FAMILIES:
        picks += [r for r in order if test(s.plans.row(r))][:1]
    picks += pareto_front(s)
    for code in (OVER_BUDGET, OVER_DEADLINE):
        picks += [r for r in order if status[r] == code][:1]
    picks += [int(r) for r in np.flatnonzero(status == OVER_MEMORY)[:1]]
    rows, seen = [], set()
    for r in picks:
        if r in seen:
            continue
        seen.add(r)
        st = STATUSES[status[r]]
        if r == chosen:
            st = "selected"
        elif r == fallback:
            st = MEMORY_FALLBACK
        elif r == nominal or st == "selected":
            st = "less robust"
        reason = why(s, r, chosen, budget, st)
        rows.append(plan_row(s, r, st, reason, float(spread[r]), calibrated, validated, time_tag))
    return rows
