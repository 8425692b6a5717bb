"""The planner's Python API, shaped like Ray's: a config in, `fit()`, a typed result out.

    >>> from service import Planner
    >>> result = Planner("experiments/llama2-13b-32xh100.yaml", top_k=5).fit()
    >>> result.selected.plan.short(), result.selected.estimate.dollars      # doctest: +SKIP
    >>> result.why_not(some_plan)                                            # doctest: +SKIP

`rank_plans` (service/plans/rank.py) is the pure core (enumerate, score in one vectorised pass, select);
`Planner.fit` wraps it into a `PlanResult` that keeps the scored table, so it can say why any plan lost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from service.costmodel.result import Estimate, EstimateTable
from service.plans.enumerate import COMBINATION_REASONS, DEFAULT_MAX_MICRO_BATCH
from service.plans.rank import Ranking, rank_plans
from service.plans.select import (
    GIB,
    STATUSES,
    objective_order,
)
from service.plans.space import outside_space
from service.spec import (
    Budget,
    ClusterSpec,
    ExperimentSpec,
    ModelSpec,
    Plan,
    SpecError,
    Workload,
    check_plan,
    load_experiment,
    plan_problem,
)
from service.spec.params import ModelParams, load_params
from service.spec.plan import Precision
from service.spec.plan_table import PRECISION_CODES, PlanTable


class RankedPlan(BaseModel):
    """One scored plan: its place in the ranking (1 = best; None when it does not fit), its status
    (selected, over memory, over budget, over deadline, slower, costlier, tied, riskier) and its
    estimate."""

    model_config = ConfigDict(frozen=True)

    rank: int | None
    status: str
    estimate: Estimate

    @property
    def plan(self) -> Plan:
        return self.estimate.plan

    def __str__(self) -> str:  # pydantic's own __str__ lists every field
        return repr(self)

    def __repr__(self) -> str:
        e = self.estimate
        return (
            f"RankedPlan(#{self.rank} {self.status} {self.plan.short()}: {e.tokens_per_s:,.0f} tokens/s, "
            f"{e.hours:,.2f} h, ${e.dollars:,.0f}, {e.memory_per_gpu_bytes.total / GIB:.1f} GiB/GPU)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "status": self.status,
            "label": self.plan.short(),
            **self.estimate.model_dump(),
        }


@dataclass(frozen=True)
class PlanResult:
    """The planner's answer. `selected` is None when no plan meets the budget; then `binding_constraint`
    names what binds and `fallback` is the cheapest plan that meets the deadline (or the fastest)."""

    experiment: str
    objective: str
    budget: Budget
    candidates: int
    plans_evaluated: int
    rejected_counts: dict[str, int]
    selected: RankedPlan | None
    ranked: list[RankedPlan]
    binding_constraint: str | None
    fallback: RankedPlan | None
    message: str
    elapsed_s: float
    _ranking: Ranking = field(repr=False)
    _spec: ExperimentSpec = field(repr=False)
    _max_micro_batch: int = field(repr=False)
    _precision: str = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the selection, the top-K ranking, counts and the message."""
        return {
            "experiment": self.experiment,
            "objective": self.objective,
            "budget": self.budget.model_dump(),
            "selected": self.selected.to_dict() if self.selected else None,
            "binding_constraint": self.binding_constraint,
            "fallback": self.fallback.to_dict() if self.fallback else None,
            "message": self.message,
            "ranked": [r.to_dict() for r in self.ranked],
            "candidates": self.candidates,
            "plans_evaluated": self.plans_evaluated,
            "rejected_counts": self.rejected_counts,
            "elapsed_s": self.elapsed_s,
            "params": self._ranking.estimates.params.summary().model_dump(),
        }

    @property
    def tie_partner(self) -> Plan | None:
        """What a first-hour A/B times beside the choice: the best plan on paper among the others in the
        choice's tie group (the model's nominal best when the choice won the tie on risk); None when
        nothing ties it."""
        sel, est = self._ranking.selection, self._ranking.estimates
        others = sel.ties[1:]
        if sel.selected is None or len(others) == 0:
            return None
        best = int(objective_order(est, others, self.objective)[0])
        return self._ranking.enumeration.plans.row(best)

    def why_not(self, plan: Plan) -> str:
        """Why `plan` was not selected (or that it was), with the numbers that decided it."""
        row = _find_row(self._ranking.enumeration.plans, plan)
        if row is None:
            return self._not_enumerated(plan)
        est, sel = self._ranking.estimates, self._ranking.selection
        status = STATUSES[sel.status[row]]
        best = sel.selected
        if status == "selected":
            return (
                f"selected: the lowest-risk plan within the model's resolution of the best {self.objective} "
                "of the plans that fit and meet the budget"
            )
        if status in ("over memory", "over budget", "over deadline", "slower", "costlier"):
            return self._lost(status, est, row)
        assert best is not None
        label = self._ranking.enumeration.plans.row(best).short()
        gap = (
            f"${est.dollars[row]:,.0f} vs ${est.dollars[best]:,.0f}"
            if self.objective == "cost"
            else f"{est.tokens_per_s[row]:,.0f} vs {est.tokens_per_s[best]:,.0f} tokens/s"
        )
        reasons = sel.risk.why_riskier(row, best) if sel.risk is not None else []
        return f"{status}: {gap} for {label}, inside the model's resolution; " + (
            "; ".join(reasons) if reasons else "as safe, and not ahead on the objective"
        )

    def _not_enumerated(self, plan: Plan) -> str:
        spec = self._spec
        problem = plan_problem(plan, spec.model, spec.cluster, spec.workload)
        if problem:
            return f"invalid: {problem[0]}: {problem[1]}"
        why = outside_space(
            plan,
            spec.cluster,
            spec.engines,
            self._max_micro_batch,
            self._precision,  # type: ignore[arg-type]
            spec.quantized_collectives,
        )
        if why is None and self._ranking.pruning is not None:
            return self._pruned(plan)
        return f"not enumerated: {why or 'not a candidate of this enumeration'}"

    def _lost(self, status: str, plan_est: EstimateTable, row: int) -> str:
        """Why a plan of `status` (over memory or budget, slower, costlier) lost, from its estimate
        (row `row` of `plan_est`) and the choice's."""
        if status == "over memory":
            return (
                f"over memory: needs {plan_est.total_bytes[row] / GIB:.1f} GiB per GPU, the limit is "
                f"{plan_est.memory_limit_bytes[row] / GIB:.1f} GiB "
                f"after {self.budget.memory_headroom:.0%} headroom"
            )
        if status in ("over budget", "over deadline"):
            return "; ".join(_over_limits(plan_est, row, self.budget))
        est, best = self._ranking.estimates, self._ranking.selection.selected
        assert best is not None
        label = self._ranking.enumeration.plans.row(best).short()
        if status == "slower":
            ours, theirs = plan_est.tokens_per_s[row], est.tokens_per_s[best]
            return f"slower: {ours:,.0f} tokens/s vs {theirs:,.0f} for {label}"
        return f"costlier: ${plan_est.dollars[row]:,.0f} vs ${est.dollars[best]:,.0f} for {label}"

    def _pruned(self, plan: Plan) -> str:
        """Why a plan the bounded ranking did not score lost: scored on its own, it is over memory or
        budget, or behind the choice beyond the tie (its layout's bound put it there)."""
        from service.costmodel import estimate_table
        from service.costmodel.goodput import with_goodput
        from service.plans.bound import structure_bound_s

        spec, params = self._spec, self._ranking.estimates.params
        table = PlanTable.from_plans([plan])
        one = estimate_table(
            spec.model, spec.cluster, spec.workload, table, self.budget.memory_headroom, params
        )
        if spec.goodput is not None:
            one = with_goodput(one, spec.model, spec.cluster, self._precision, spec.goodput)
        if not one.fits[0]:
            return self._lost("over memory", one, 0)
        if _over_limits(one, 0, self.budget):
            return self._lost("over budget", one, 0)
        bound_s = structure_bound_s(
            spec.model, spec.cluster, spec.workload, table, self._max_micro_batch, (self._precision,), params,  # type: ignore[arg-type]
        )[0]  # fmt: skip
        lost = self._lost("slower" if self.objective == "throughput" else "costlier", one, 0)
        return f"{lost} (not scored: its layout's bound, {bound_s:,.2f} s per step, is beyond the tie)"


def _message(ranking: Ranking) -> str:
    """The selection's message; with no valid plan at all, the rules that turned most candidates away."""
    sel = ranking.selection
    if sel.binding != "no valid plan":
        return f"{sel.message}. {sel.tie_note}" if sel.tie_note else sel.message
    counts = ranking.enumeration.invalid_counts.items()
    top = [(reason, n) for reason, n in counts if reason not in COMBINATION_REASONS][:3]
    reasons = "; ".join(f"{reason}: {n:,}" for reason, n in top)
    return f"{sel.message} (of {ranking.enumeration.candidates:,} candidates: {reasons})"


def _over_limits(est: EstimateTable, row: int, budget: Budget) -> list[str]:
    reasons = []
    if budget.max_dollars is not None and est.dollars[row] > budget.max_dollars:
        reasons.append(f"over budget: ${est.dollars[row]:,.0f} > max_dollars ${budget.max_dollars:,.0f}")
    if budget.max_hours is not None and est.hours[row] > budget.max_hours:
        reasons.append(f"over deadline: {est.hours[row]:,.1f} h > max_hours {budget.max_hours:g} h")
    return reasons


def _find_row(table: PlanTable, plan: Plan) -> int | None:
    """Index of `plan` in `table`, or None."""
    encoded = PlanTable.from_plans([plan])
    mask = None
    for name in Plan.model_fields:
        eq = getattr(table, name) == getattr(encoded, name)[0]
        mask = eq if mask is None else mask & eq
    hits = mask.nonzero()[0] if mask is not None else []
    return int(hits[0]) if len(hits) else None


class Planner:
    """Ranks every valid plan of an experiment and selects one under its budget. Hours and dollars are
    the run's expected wall-clock with the experiment's `goodput` (interruptions, checkpoints, restarts),
    as `run` prices them, so both check the budget against the same numbers.

    Args:
        experiment: an `ExperimentSpec`, or the path of its YAML file.
        top_k: how many plans `PlanResult.ranked` keeps (the ranking itself covers all).
        budget: replaces the experiment's budget (limits, objective, memory headroom).
        max_micro_batch: largest micro-batch tried; micro-batches are powers of two up to it.
        precision: compute precision of every plan (bf16 or fp16 mixed precision, or fp32).
        params: the cost model's parameter set, a `ModelParams` or the path of its YAML file
            (default: the shipped set, fit on the published runs; see `python -m service calibrate`).
        prune: skip the layouts whose lower bound on the step time cannot reach the choice's tie group
            or the `top_k` (service/plans/bound.py): the same selection, tie group and top plans that
            fit and meet the budget, the rest counted, not scored. For spaces of millions of plans (a
            mixture of experts on thousands of GPUs).

    Example:
        >>> result = Planner("experiments/llama2-13b-32xh100.yaml", top_k=3).fit()  # doctest: +SKIP
        >>> print(result.message)                                                    # doctest: +SKIP
    """

    def __init__(
        self,
        experiment: ExperimentSpec | str | Path,
        *,
        top_k: int = 10,
        budget: Budget | None = None,
        max_micro_batch: int = DEFAULT_MAX_MICRO_BATCH,
        precision: Precision = "bf16",
        params: ModelParams | str | Path | None = None,
        prune: bool = False,
    ):
        spec = experiment if isinstance(experiment, ExperimentSpec) else load_experiment(experiment)
        if top_k < 0:
            raise SpecError("top_k", f"must be 0 or more, got {top_k}")
        if precision not in PRECISION_CODES:
            raise SpecError(
                "precision", f"unknown precision {precision!r}; allowed: {', '.join(PRECISION_CODES)}"
            )
        if max_micro_batch < 1:
            raise SpecError("max_micro_batch", f"must be 1 or more, got {max_micro_batch}")
        self.spec = spec.model_copy(update={"budget": budget}) if budget is not None else spec
        self.top_k = top_k
        self.max_micro_batch = max_micro_batch
        self.precision: Precision = precision
        self.params = params if isinstance(params, ModelParams) else load_params(params)
        self.prune = prune

    def fit(self) -> PlanResult:
        spec, started = self.spec, time.perf_counter()
        ranking = rank_plans(
            spec.model,
            spec.cluster,
            spec.workload,
            spec.budget,
            self.max_micro_batch,
            self.precision,
            self.params,
            spec.engines,
            spec.quantized_collectives,
            # hours and dollars as `run` prices them: interruptions, checkpoints and restarts included
            goodput=spec.goodput,
            prune=self.prune,
            keep_top=self.top_k,
        )
        sel, plans, est = ranking.selection, ranking.enumeration.plans, ranking.estimates

        def entry(row: int) -> RankedPlan:
            hit = (sel.order == row).nonzero()[0]
            rank = int(hit[0]) + 1 if len(hit) else None
            return RankedPlan(
                rank=rank,
                status=STATUSES[sel.status[row]],
                estimate=Estimate.from_table(est, plans.row(row), row),
            )

        return PlanResult(
            experiment=spec.name,
            objective=spec.budget.objective,
            budget=spec.budget,
            candidates=ranking.enumeration.candidates,
            plans_evaluated=len(plans),
            rejected_counts=ranking.rejected_counts(),
            selected=entry(sel.selected) if sel.selected is not None else None,
            ranked=[entry(int(r)) for r in sel.order[: self.top_k]],
            binding_constraint=sel.binding,
            fallback=entry(sel.fallback) if sel.fallback is not None else None,
            message=_message(ranking),
            elapsed_s=time.perf_counter() - started,
            _ranking=ranking,
            _spec=spec,
            _max_micro_batch=self.max_micro_batch,
            _precision=self.precision,
        )


def estimate_plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: Plan,
    workload: Workload,
    memory_headroom: float = 0.10,
    params: ModelParams | None = None,
) -> Estimate:
    """The cost model's estimate for one plan, after checking it (`SpecError` naming the field)."""
    from service.costmodel import estimate

    check_plan(plan, model, cluster, workload)
    return estimate(model, cluster, plan, workload, memory_headroom=memory_headroom, params=params)
