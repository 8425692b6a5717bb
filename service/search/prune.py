"""Model-guided pruning and ordering: which points of a space become trials, and in what order.

Every point becomes a full proxy-scale `Plan` (dp = proxy.num_workers / (tp·pp)); the rules on whether
it can run are `Plan`'s own validator and `proxy_plan_problem` (which uses `plan_problem`), never
re-implemented here. A plan the cost model predicts will not fit in memory is pruned too (unless the
search is unguided, the baseline), and the survivors are ordered by the predicted value of the
search metric, best first: the planner's ranking decides what is measured first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from service.search.space import SearchSpace
from service.spec.experiment import ExperimentSpec
from service.spec.plan import Plan
from service.spec.record import PREDICTED, Metrics
from service.spec.units import GIB
from service.train.proxy_scale import plan_for_point

__all__ = ["Candidate", "PruneResult", "PrunedPlan", "plan_for_point", "proxy_prediction", "prune_space"]

PruneKind = Literal["invalid", "constraint", "predicted_oom"]


@dataclass(frozen=True)
class Candidate:
    """A plan that will be launched, with the model's prediction for it at proxy scale."""

    key: str
    plan: Plan
    predicted: Metrics
    predicted_value: float  # the search metric as predicted; NaN when the model could not say
    note: str = ""


@dataclass(frozen=True)
class PrunedPlan:
    """A point of the space that is never launched, and why."""

    point: dict[str, Any]
    reason: str
    kind: PruneKind
    plan: Plan | None = None
    predicted: Metrics = field(default_factory=Metrics)

    @property
    def label(self) -> str:
        if self.plan is not None:
            return self.plan.short()
        return "-".join(f"{k}={v}" for k, v in self.point.items())


@dataclass(frozen=True)
class PruneResult:
    candidates: list[Candidate]  # launch order
    pruned: list[PrunedPlan]

    @property
    def size(self) -> int:
        return len(self.candidates) + len(self.pruned)


def proxy_prediction(experiment: ExperimentSpec, plan: Plan) -> Metrics:
    """The cost model's numbers for `plan` at proxy scale (`predict_proxy`); raises what the model
    raises."""
    from service.train.proxy_scale import predict_proxy

    return predict_proxy(experiment, plan)


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def predicted_value(metric: str, predicted: Metrics, seq_len: int) -> float:
    """The search metric as the cost model predicts it (samples/s = tokens/s ÷ sequence length)."""
    if metric == "tokens_per_s":
        return _or_nan(predicted.tokens_per_s)
    if metric == "samples_per_s":
        return _or_nan(predicted.tokens_per_s) / seq_len
    if metric == "step_time_s":
        return _or_nan(predicted.step_time_s)
    return _or_nan(predicted.peak_memory_bytes_per_rank)


def _judge(
    experiment: ExperimentSpec, space: SearchSpace, point: dict[str, Any], guided: bool
) -> Candidate | PrunedPlan:
    from service.train.proxy_scale import proxy_plan_problem, proxy_workload

    try:
        plan = plan_for_point(experiment, point)
    except ValidationError as err:
        reason = str(err.errors(include_url=False)[0]["msg"]).removeprefix("Value error, ")
        return PrunedPlan(point, reason, "invalid")
    problem = proxy_plan_problem(experiment, plan)
    if problem:
        return PrunedPlan(point, problem, "invalid", plan)
    broken = space.constraints.violation(point, plan.sequences_per_step)
    if broken:
        return PrunedPlan(point, broken, "constraint", plan)
    try:
        predicted = proxy_prediction(experiment, plan)
    except Exception as err:  # a model failure must not hide a runnable plan: run it, ranked last
        note = f"no prediction: {type(err).__name__}: {err}"
        return Candidate(plan.short(), plan, Metrics(), math.nan, note=note)
    if guided and _or_nan(predicted.fits) < 0.5:
        peak_gib = _or_nan(predicted.peak_memory_bytes_per_rank) / GIB
        reason = f"predicted not to fit: peak {peak_gib:.2f} GiB per rank"
        return PrunedPlan(point, reason, "predicted_oom", plan, predicted)
    seq_len = proxy_workload(experiment, plan).seq_len
    return Candidate(plan.short(), plan, predicted, predicted_value(space.metric, predicted, seq_len))


def prune_space(experiment: ExperimentSpec, space: SearchSpace, guided: bool = True) -> PruneResult:
    """Splits the space into candidates (ordered best-predicted first when `guided`) and pruned plans.

    Unguided (the grid baseline) keeps the space's own order and launches predicted-OOM plans too;
    invalid plans and constraint violations are never launched either way. Duplicate plans (two points
    giving the same Plan) are launched once.
    """
    candidates: list[Candidate] = []
    pruned: list[PrunedPlan] = []
    seen: set[str] = set()
    for point in space.points():
        verdict = _judge(experiment, space, point, guided)
        if isinstance(verdict, PrunedPlan):
            pruned.append(verdict)
        elif verdict.key not in seen:
            seen.add(verdict.key)
            candidates.append(verdict)
    if guided:
        sign = -1.0 if space.direction == "max" else 1.0
        candidates.sort(key=lambda c: (math.isnan(c.predicted_value), sign * _or_zero(c.predicted_value)))
    return PruneResult(candidates, pruned)


def _or_zero(x: float) -> float:
    return 0.0 if math.isnan(x) else x


def pruning_to_json(result: PruneResult) -> dict[str, Any]:
    """The pruning a search decided, so a restored search launches exactly the same candidates."""
    return {
        "candidates": [{"key": c.key, "plan": c.plan.model_dump(), "predicted": c.predicted.model_dump(),
                        "predicted_value": c.predicted_value, "note": c.note} for c in result.candidates],
        "pruned": [{"point": p.point, "reason": p.reason, "kind": p.kind,
                    "predicted": p.predicted.model_dump(),
                    "plan": p.plan.model_dump() if p.plan else None} for p in result.pruned],
    }  # fmt: skip


def _saved_prediction(data: dict[str, Any]) -> Metrics:
    """A saved prediction; a search saved before predictions were typed kept `predicted_x` keys."""
    if any(k.startswith(PREDICTED) for k in data):
        return Metrics.from_prefixed(data, PREDICTED)
    return Metrics.model_validate(data)


def pruning_from_json(data: dict[str, Any]) -> PruneResult:
    candidates = [
        Candidate(
            c["key"],
            Plan.model_validate(c["plan"]),
            _saved_prediction(c["predicted"]),
            c["predicted_value"],
            c["note"],
        )
        for c in data["candidates"]
    ]
    pruned = [
        PrunedPlan(p["point"], p["reason"], p["kind"], Plan.model_validate(p["plan"]) if p["plan"] else None,
                   _saved_prediction(p["predicted"]))
        for p in data["pruned"]
    ]  # fmt: skip
    return PruneResult(candidates, pruned)
