"""Selection under a budget, on synthetic scored tables: the winner, why each other plan lost, and
the answer when nothing meets the budget."""

from __future__ import annotations

import numpy as np

from service.plans.select import (
    COSTLIER,
    OVER_BUDGET,
    OVER_DEADLINE,
    OVER_MEMORY,
    RISKIER,
    SELECTED,
    SLOWER,
    STATUSES,
    select_plan,
)
from service.spec import Budget

GIB = 1024**3

# Six plans: 0 does not fit; 1 is over the dollars; 2 is over the hours; 3, 4, 5 meet the budget.
TOKENS = [9e5, 8e5, 7e5, 5e5, 6e5, 4e5]
DOLLARS = [100, 2000, 900, 800, 1000, 600]
HOURS = [1, 5, 30, 10, 8, 12]
FITS = [False, True, True, True, True, True]


def test_throughput_objective_picks_most_tokens_within_budget(make_estimates, make_plans):
    est = make_estimates(tokens_per_s=TOKENS, dollars=DOLLARS, hours=HOURS, fits=FITS)
    sel = select_plan(make_plans(6), est, Budget(max_dollars=1500, max_hours=24, objective="throughput"))
    assert sel.selected == 4 and sel.binding is None and sel.fallback is None
    assert sel.status.tolist() == [OVER_MEMORY, OVER_BUDGET, OVER_DEADLINE, SLOWER, SELECTED, SLOWER]
    assert sel.order.tolist() == [4, 3, 5, 1, 2]  # within budget by tokens/s, then the rest by tokens/s
    assert sel.counts() == {
        "over memory": 1, "over budget": 1, "over deadline": 1, "slower": 2, "costlier": 0, "tied": 0,
        "riskier": 0,
    }  # fmt: skip
    assert "dp5-" in sel.message and "600,000 tokens/s" in sel.message and "$1,000" in sel.message


def test_cost_objective_picks_fewest_dollars_within_budget(make_estimates, make_plans):
    est = make_estimates(tokens_per_s=TOKENS, dollars=DOLLARS, hours=HOURS, fits=FITS)
    sel = select_plan(make_plans(6), est, Budget(max_dollars=1500, max_hours=24, objective="cost"))
    assert sel.selected == 5
    assert sel.status.tolist() == [OVER_MEMORY, OVER_BUDGET, OVER_DEADLINE, COSTLIER, COSTLIER, SELECTED]
    assert sel.order.tolist() == [5, 3, 4, 2, 1]


def test_ties_are_broken_by_the_other_objective_and_named_accordingly(make_estimates, make_plans):
    est = make_estimates(tokens_per_s=[5e5, 5e5, 4e5], dollars=[700, 600, 600], hours=[1, 1, 1])
    by_cost = select_plan(make_plans(3), est, Budget(objective="cost"))
    assert by_cost.selected == 1 and by_cost.status.tolist() == [COSTLIER, SELECTED, SLOWER]
    by_speed = select_plan(make_plans(3), est, Budget(objective="throughput"))
    assert by_speed.selected == 1 and by_speed.status.tolist() == [COSTLIER, SELECTED, SLOWER]


def test_exact_ties_go_to_the_plan_with_fewer_offloads(make_estimates, make_plans):
    est = make_estimates(tokens_per_s=[5e5, 5e5, 5e5], dollars=[600, 600, 600], hours=[1, 1, 1])
    plans = make_plans(3)
    offloaded = type(plans)(**{**plans.__dict__, "offload_optimizer": np.array([True, False, True])})
    for objective in ("cost", "throughput"):
        sel = select_plan(offloaded, est, Budget(objective=objective))
        assert sel.selected == 1 and sel.status.tolist() == [RISKIER, SELECTED, RISKIER]
        assert sel.counts()["riskier"] == 2


def test_no_limits_means_every_fitting_plan_competes(make_estimates, make_plans):
    est = make_estimates(tokens_per_s=TOKENS, dollars=DOLLARS, hours=HOURS, fits=FITS)
    sel = select_plan(make_plans(6), est, Budget())
    assert sel.selected == 1  # the fastest plan that fits, whatever it costs
    assert sum(sel.counts().values()) + 1 == 6


def test_memory_is_reported_before_budget_and_budget_before_deadline(make_estimates, make_plans):
    est = make_estimates(
        tokens_per_s=[1e5, 1e5, 1e5], dollars=[5000, 5000, 10], hours=[99, 99, 1], fits=[0, 1, 1]
    )
    sel = select_plan(make_plans(3), est, Budget(max_dollars=100, max_hours=10))
    assert [STATUSES[s] for s in sel.status] == ["over memory", "over budget", "selected"]


def test_nothing_fits_in_memory_names_the_smallest_plan(make_estimates, make_plans):
    est = make_estimates(
        tokens_per_s=[1, 2], dollars=[1, 1], hours=[1, 1], fits=[0, 0], total_bytes=[90 * GIB, 85.5 * GIB]
    )
    sel = select_plan(make_plans(2), est, Budget(max_dollars=10))
    assert sel.selected is None and sel.binding == "memory" and sel.fallback is None
    assert "dp2-" in sel.message and "85.5 GiB" in sel.message and "72.0 GiB" in sel.message
    assert len(sel.order) == 0


def test_dollars_bind_fallback_is_the_cheapest_plan_meeting_the_deadline(make_estimates, make_plans):
    # Plan 0 is cheapest overall but misses the deadline; plan 2 is the cheapest that meets it.
    est = make_estimates(tokens_per_s=[1e5, 4e5, 3e5], dollars=[500, 1200, 1100], hours=[40, 10, 12])
    sel = select_plan(make_plans(3), est, Budget(max_dollars=1000, max_hours=24))
    assert sel.selected is None and sel.binding == "max_dollars" and sel.fallback == 2
    assert sel.status.tolist() == [OVER_DEADLINE, OVER_BUDGET, OVER_BUDGET]
    assert "max_dollars binds" in sel.message and "dp3-" in sel.message and "$1,100" in sel.message
    assert "within 24 h" in sel.message


def test_hours_bind_fallback_is_the_fastest_plan(make_estimates, make_plans):
    est = make_estimates(tokens_per_s=[1e5, 4e5, 3e5], dollars=[500, 900, 800], hours=[40, 30, 35])
    sel = select_plan(make_plans(3), est, Budget(max_dollars=1000, max_hours=24))
    assert sel.binding == "max_hours" and sel.fallback == 1
    assert sel.status.tolist() == [OVER_DEADLINE] * 3
    assert "30.0 h" in sel.message and "dp2-" in sel.message


def test_both_bind_when_no_plan_meets_either(make_estimates, make_plans):
    est = make_estimates(tokens_per_s=[1e5, 4e5], dollars=[5000, 9000], hours=[40, 30])
    sel = select_plan(make_plans(2), est, Budget(max_dollars=1000, max_hours=24))
    assert sel.binding == "max_hours and max_dollars" and sel.fallback == 1
    assert "more than $1,000" in sel.message


def test_empty_table_has_no_valid_plan(make_estimates, make_plans):
    est = make_estimates(tokens_per_s=np.zeros(0))
    sel = select_plan(make_plans(0), est, Budget())
    assert sel.selected is None and sel.binding == "no valid plan"
    assert sel.counts()["slower"] == 0
