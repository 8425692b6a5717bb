"""Plans in bulk: enumeration of every valid plan, the vectorised table, selection under a budget."""

from service.plans.enumerate import (
    INVALID_REASONS,
    Enumeration,
    candidate_table,
    enumerate_plans,
    problem_codes,
)
from service.plans.select import STATUSES, Selection, select_plan
from service.plans.table import PlanTable

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
