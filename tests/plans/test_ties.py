"""Ties are ties: plans within the model's resolution of the best go to the lowest-risk one, each
reason named; on the seed's ranking, plain ZeRO-3 wins its tie group and no offload plan is chosen."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.plans.risk import MEMORY_RISK_ERROR, risk_of
from service.plans.select import COSTLIER, RISKIER, SELECTED, SLOWER, select_plan, tie_group
from service.spec import Budget
from tests.plans.conftest import labelled_plans, synthetic_estimates

REPO = Path(__file__).resolve().parents[2]
GIB = 1024**3
RESOLUTION = float(np.log(1.05))  # plans within 5 % tie


def _plans(n: int, **cols: list[int]):  # type: ignore[no-untyped-def]
    base = labelled_plans(n)
    return type(base)(**{**base.__dict__, **{k: np.asarray(v) for k, v in cols.items()}})


def test_plans_within_the_resolution_tie_and_the_safest_wins():
    """0 is cheapest but offloads; 1 is 3 % dearer with hpZ; 2 is 4 % dearer and plain; 3 is 10 %
    dearer: outside the group. The plain plan wins; 0 and 1 lose it on a named risk; 3 is costlier."""
    est = synthetic_estimates(
        tokens_per_s=[1e5] * 4, dollars=[100, 103, 104, 110], hours=[1.0, 1.03, 1.04, 1.1]
    )
    plans = _plans(4, offload_optimizer=[1, 0, 0, 0], zero_hpz_partition_size=[1, 8, 1, 1])
    sel = select_plan(plans, est, Budget(objective="cost"), RESOLUTION)
    assert sel.selected == 2
    assert sel.status.tolist() == [RISKIER, RISKIER, SELECTED, COSTLIER]
    assert sel.ties.tolist() == [2, 1, 0]  # safest first: hpZ (one moving part) before the offload
    assert "offloads to host memory" in sel.tie_note and plans.row(0).short() in sel.tie_note
    assert "A/B" in sel.tie_note  # what would separate them, named
    assert sel.risk is not None
    assert sel.risk.why_riskier(1, 2)[1:] == ["has more moving parts (ZeRO++ hpZ)"]
    assert sel.risk.why_riskier(1, 2)[0].startswith("uses a feature with defects reported open (hpZ:")
    # the group's width as a regret: 5 % (what the sensitivity compares a plan's regret with)
    assert abs(sel.tie_regret - 0.05) < 1e-12


def test_a_feature_with_open_defects_loses_a_tie_before_memory_margin_and_moving_parts():
    """0 uses hpZ (DeepSpeed defects reported open); 1 is 2 % dearer, tight on memory and uses context
    parallelism: 1 wins, the defect named; the same plans on FSDP record no defects."""
    est = synthetic_estimates(
        tokens_per_s=[1e5, 1e5], dollars=[100, 102], hours=[1, 1], total_bytes=[50 * GIB, 70 * GIB]
    )
    plans = _plans(2, zero_hpz_partition_size=[8, 1], cp=[1, 2], zero_stage=[3, 3])
    sel = select_plan(plans, est, Budget(objective="cost"), RESOLUTION)
    assert sel.selected == 1 and sel.status.tolist() == [RISKIER, SELECTED]
    assert sel.risk is not None and sel.risk.why_riskier(0, 1)[0].startswith("uses a feature with defects")
    fsdp = _plans(2, zero_hpz_partition_size=[8, 1], cp=[1, 2], zero_stage=[3, 3], engine=[1, 1])
    assert risk_of(fsdp, est).defect_count.tolist() == [0, 0]


def test_every_reported_defect_names_a_plan_column_and_an_issue():
    from service.spec.engine import ENGINES, engine_rules
    from service.spec.plan_table import PlanTable

    columns = set(PlanTable.__dataclass_fields__)
    for engine in ENGINES:
        rules = engine_rules(engine)
        assert set(rules.open_defects) <= columns, engine
        assert all("#" in text for text in rules.open_defects.values()), engine


def test_without_a_resolution_only_exact_ties_tie():
    est = synthetic_estimates(tokens_per_s=[1e5] * 3, dollars=[100, 103, 104], hours=[1] * 3)
    plans = _plans(3, offload_optimizer=[1, 0, 0])
    sel = select_plan(plans, est, Budget(objective="cost"))
    assert sel.selected == 0 and sel.tie_note == "" and sel.ties.tolist() == [0]


def test_memory_margin_is_a_named_risk():
    """Plan 0 would pass the 72 GiB limit if its activations were 25 % larger; plan 1 would not."""
    est = synthetic_estimates(
        tokens_per_s=[1e5, 1e5],
        dollars=[100, 102],
        hours=[1, 1],
        total_bytes=[68 * GIB, 50 * GIB],
        activations_bytes=[40 * GIB, 30 * GIB],
    )
    risk = risk_of(labelled_plans(2), est)
    assert 68 + MEMORY_RISK_ERROR * 40 > 72 > 50 + MEMORY_RISK_ERROR * 30
    assert risk.tight_memory.tolist() == [True, False]
    sel = select_plan(labelled_plans(2), est, Budget(objective="cost"), RESOLUTION)
    assert sel.selected == 1
    assert "memory limit" in sel.tie_note


def test_the_group_is_measured_from_the_best_objective_for_throughput_too():
    est = synthetic_estimates(tokens_per_s=[1.00e5, 0.96e5, 0.90e5], dollars=[1, 1, 1], hours=[1] * 3)
    group = tie_group(est, np.array([0, 1, 2]), "throughput", RESOLUTION)
    assert group.tolist() == [0, 1]  # 1/0.96 = +4.2 % inside 5 %; 1/0.90 = +11 % outside


def test_the_seed_chooses_plain_zero3_among_its_ties_and_no_offload():
    """The seed's best plans lie within the shipped set's resolution (the offset-free scatter of its
    out-of-sample errors): plain ZeRO-3 over 32 GPUs has the fewest moving parts and wins; hpZ,
    nominally a little cheaper, is tied; no plan that offloads is chosen."""
    from service.planner import Planner

    result = Planner(REPO / "experiments" / "llama2-13b-32xh100.yaml").fit()
    sel = result._ranking.selection
    from service.spec.params import load_params

    # the scatter, widened as the interval is: the fit never saw DeepSpeed ZeRO-3 on H100
    shipped = load_params()
    assert sel.resolution == pytest.approx(shipped.residuals.scatter * (1 + shipped.widen_unseen_stack))
    assert result.selected is not None
    assert result.selected.plan.short() == "dp32-tp1-pp1-z3-mb1-ga4-rc:none"
    ties = [result._ranking.enumeration.plans.row(int(r)).short() for r in sel.ties]
    assert "dp32-tp1-pp1-z3-hpz8-mb1-ga4-rc:none" in ties
    assert "has more moving parts (ZeRO++ hpZ)" in sel.tie_note
    assert "deepspeedai/DeepSpeed#7164" in sel.tie_note  # hpZ's open defects, named
    assert "offpar" not in result.selected.plan.short() and "offopt" not in result.selected.plan.short()
    assert sel.tie_note in result.message
    # The first-hour A/B the memo names times the choice beside the model's nominal best.
    assert result.tie_partner is not None
    assert result.tie_partner.short() == "dp32-tp1-pp1-z3-hpz8-mb1-ga4-rc:none"


def test_at_a_price_of_zero_the_cost_objective_ties_on_hours():
    """A free cluster (the CPU experiment): every plan costs $0, so dollars cannot be compared as ratios;
    the hours they are priced from can. 0 offloads and is 1 % faster than 1: they tie and 1 wins."""
    est = synthetic_estimates(tokens_per_s=[1.01e5, 1e5, 8e4], dollars=[0.0] * 3, hours=[1.0, 1.01, 1.25])
    plans = _plans(3, offload_optimizer=[1, 0, 0])
    sel = select_plan(plans, est, Budget(objective="cost"), RESOLUTION)
    assert sel.selected == 1 and sel.ties.tolist() == [1, 0]
    assert sel.status.tolist() == [RISKIER, SELECTED, SLOWER]  # as dear at $0, and 20 % slower
