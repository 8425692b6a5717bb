"""The Python API: `Planner(...).fit() -> PlanResult`, `why_not`, `to_dict`, `estimate_plan`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from service import Budget, Planner, PlanResult, SpecError, estimate_plan, load_experiment
from service.catalog import load_model
from service.costmodel import estimate
from service.plans.select import STATUSES
from service.spec import Plan, check_plan

EXPERIMENT = Path(__file__).resolve().parents[1] / "experiments" / "llama2-13b-32xh100.yaml"


@pytest.fixture(scope="module")
def spec():
    return load_experiment(EXPERIMENT)


@pytest.fixture(scope="module")
def result(spec) -> PlanResult:
    return Planner(spec, top_k=10).fit()


def test_fit_selects_a_valid_plan_within_budget(spec, result):
    sel = result.selected
    assert sel is not None and sel.status == "selected" and sel.rank == 1
    check_plan(sel.plan, spec.model, spec.cluster, spec.workload)
    est = sel.estimate
    assert est.fits and est.memory_per_gpu_bytes.total <= est.memory_limit_bytes
    assert est.dollars <= 1500 and est.hours <= 24
    assert result.plans_evaluated == 2730 and result.candidates == 46200
    assert sum(result.rejected_counts.values()) + 1 == result.candidates
    assert result.ranked[0] == sel and len(result.ranked) == 10
    assert [r.rank for r in result.ranked] == list(range(1, 11))
    assert result.binding_constraint is None and result.fallback is None


def test_vectorised_ranking_agrees_with_scalar_estimates(spec, result):
    """The selected plan is the cheapest (cost objective) of a brute-force scalar scoring of the plans."""
    plans = result._ranking.enumeration.plans
    rng = np.random.default_rng(0)
    rows = rng.choice(len(plans), size=80, replace=False)
    table = result._ranking.estimates
    for i in rows:
        one = estimate(
            spec.model, spec.cluster, plans.row(int(i)), spec.workload, spec.budget.memory_headroom
        )
        assert one.memory_per_gpu_bytes.total == pytest.approx(table.total_bytes[i], rel=1e-9)
        assert bool(one.fits) == bool(table.fits[i])
        # the ranking times the plans that fit; a plan over memory loses on memory alone
        timed = table.step_time_s[i] if one.fits else one.step_time_s
        assert one.step_time_s == pytest.approx(timed, rel=1e-9)
        assert one.fits or np.isnan(table.step_time_s[i])
    ok = table.fits & (table.dollars <= 1500) & (table.hours <= 24)
    assert result.selected is not None
    # Within the model's resolution of the cheapest (the tie group goes to the lowest-risk plan).
    resolution = result._ranking.selection.resolution
    assert (
        table.dollars[ok].min()
        <= result.selected.estimate.dollars
        <= table.dollars[ok].min() * np.exp(resolution)
    )
    # The ranking prices the run's wall-clock with interruptions, checkpoints and restarts (goodput);
    # the scalar estimate is the failure-free run, which the ranking keeps beside it.
    direct = estimate(spec.model, spec.cluster, result.selected.plan, spec.workload, 0.10)
    ranking, row = result._ranking, result._ranking.selection.selected
    assert direct.hours == pytest.approx(ranking.hours_no_failures[row])
    goodput = ranking.estimates.hours[row] / ranking.hours_no_failures[row]
    assert 1.0 < goodput < 1.1
    assert result.selected.estimate.dollars == pytest.approx(direct.dollars * goodput)


def test_why_not_explains_every_kind_of_loss(spec, result):
    plans, status = result._ranking.enumeration.plans, result._ranking.selection.status
    assert result.selected is not None
    assert result.why_not(result.selected.plan).startswith("selected")
    for code, prefix in [(1, "over memory: needs"), (2, "over budget: $")]:
        assert STATUSES[code] in prefix
        row = int(np.flatnonzero(status == code)[0])
        assert result.why_not(plans.row(row)).startswith(prefix)
    costlier = int(np.flatnonzero(status == STATUSES.index("costlier"))[0])
    assert result.why_not(plans.row(costlier)).startswith("costlier: $")
    riskier = next(r for r in result.ranked if r.status == "riskier")
    assert result.why_not(riskier.plan).startswith("riskier: $")
    assert "inside the model's resolution; has more moving parts" in result.why_not(riskier.plan)
    assert result.why_not(Plan(dp=2, tp=16)) == "invalid: tp: tp 16 does not divide num_attention_heads 40"
    assert result.why_not(Plan(dp=32, grad_accum=5)).startswith("invalid: grad_accum")
    small = Planner(spec, max_micro_batch=2).fit()
    assert small.why_not(Plan(dp=32, micro_batch=4, grad_accum=1)).startswith(
        "not enumerated: the planner tries"
    )


def test_to_dict_is_json_ready(result):
    data = json.loads(json.dumps(result.to_dict()))
    assert data["selected"]["label"] == result.selected.plan.short()
    assert data["selected"]["memory_per_gpu_bytes"]["total"] > 0
    assert len(data["ranked"]) == 10 and data["plans_evaluated"] == 2730


def test_throughput_objective_picks_the_fastest_feasible_plan(spec):
    res = Planner(spec, budget=Budget(max_dollars=1500, max_hours=24, objective="throughput"), top_k=5).fit()
    table = res._ranking.estimates
    ok = table.fits & (table.dollars <= 1500) & (table.hours <= 24)
    assert res.selected is not None
    best = table.tokens_per_s[ok].max()
    resolution = res._ranking.selection.resolution
    assert best / np.exp(resolution) <= res.selected.estimate.tokens_per_s <= best
    # The tie group leads the ranking, safest first; every plan in it is within the resolution.
    group = [r for r in res.ranked if r.status in ("selected", "riskier", "tied")]
    assert res.ranked[: len(group)] == group
    assert all(r.estimate.tokens_per_s >= best / np.exp(resolution) for r in group)


def test_unmeetable_budgets_name_what_binds(spec):
    poor = Planner(spec, budget=Budget(max_dollars=50, max_hours=24, objective="cost")).fit()
    assert poor.selected is None and poor.binding_constraint == "max_dollars"
    assert poor.fallback is not None and poor.fallback.estimate.hours <= 24
    table = poor._ranking.estimates
    in_time = table.fits & (table.hours <= 24)
    assert poor.fallback.estimate.dollars == pytest.approx(table.dollars[in_time].min())
    rushed = Planner(spec, budget=Budget(max_dollars=1500, max_hours=0.5)).fit()
    assert rushed.binding_constraint == "max_hours" and rushed.fallback is not None
    assert rushed.fallback.estimate.tokens_per_s == pytest.approx(table.tokens_per_s[table.fits].max())
    assert "max_hours binds" in rushed.message
    both = Planner(spec, budget=Budget(max_dollars=10, max_hours=0.5)).fit()
    assert both.binding_constraint == "max_hours and max_dollars"


def test_no_valid_plan_and_nothing_fits(spec):
    # 1 layer: no pipeline; tp <= 8 and Ulysses cp dividing the heads per TP rank leave dp >= 2 of 32
    # GPUs, and 3 sequences do not split over an even dp
    odd = spec.model_copy(
        update={
            "model": spec.model.model_copy(update={"num_layers": 1}),
            "workload": spec.workload.model_copy(update={"global_batch_sequences": 3}),
        }
    )
    res = Planner(odd).fit()
    assert res.plans_evaluated == 0 and res.binding_constraint == "no valid plan"
    assert "global batch does not split" in res.message
    big = spec.model_copy(update={"model": load_model("gpt3-175b")})
    tight = Planner(big, budget=Budget(memory_headroom=0.95)).fit()  # 5 % of 79.6 GiB left
    assert tight.binding_constraint == "memory" and tight.selected is None and tight.fallback is None
    assert "GiB per GPU; the limit after headroom is 4.0 GiB" in tight.message
    assert tight.rejected_counts["over memory"] == tight.plans_evaluated > 0


def test_planner_accepts_a_path_and_rejects_bad_settings():
    assert Planner(str(EXPERIMENT), top_k=2).fit().selected is not None
    with pytest.raises(SpecError, match="top_k"):
        Planner(EXPERIMENT, top_k=-1)
    with pytest.raises(SpecError, match="allowed: bf16, fp16, fp32"):
        Planner(EXPERIMENT, precision="int8")  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="max_micro_batch"):
        Planner(EXPERIMENT, max_micro_batch=0)


def test_estimate_plan_checks_the_plan(spec):
    est = estimate_plan(spec.model, spec.cluster, Plan(dp=32, zero_stage=3, grad_accum=4), spec.workload)
    assert est.tokens_per_s > 0 and est.plan.zero_stage == 3
    with pytest.raises(SpecError, match=r"plan\.tp: tp 16 does not divide"):
        estimate_plan(spec.model, spec.cluster, Plan(dp=2, tp=16, grad_accum=64), spec.workload)
