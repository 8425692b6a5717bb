"""Plans in bulk: enumeration of every valid plan and selection under a budget (the vectorised
`PlanTable` they work on is spec's: service/spec/plan_table.py)."""

from service.plans.enumerate import (
    INVALID_REASONS,
    Enumeration,
    candidate_table,
    enumerate_plans,
    problem_codes,
)
from service.plans.select import STATUSES, Selection, select_plan
from service.spec.plan_table import PlanTable

__all__ = [
    "INVALID_REASONS",
    "STATUSES",
    "Enumeration",
    "PlanTable",
    "Selection",
    "candidate_table",
    "enumerate_plans",
    "problem_codes",
    "select_plan",
]
