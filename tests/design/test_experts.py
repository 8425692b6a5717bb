"""The memo's expert-parallel record (service/design/experts.py): the best plan of each EP degree."""

from __future__ import annotations

from pathlib import Path

from service.design.decide import score
from service.design.experts import expert_parallelism
from service.spec import Budget, load_experiment
from service.spec.params import load_params

EXPERIMENT = Path(__file__).resolve().parents[2] / "experiments" / "qwen3-30b-a3b-64xh100.yaml"


def test_the_families_come_best_first_under_the_cost_objective_too():
    """On one cluster the fastest plan is also the cheapest, so the table lists the EP degrees fastest
    first whatever the objective (it listed the slowest first under cost)."""
    spec = load_experiment(EXPERIMENT)
    budget = Budget(objective="cost", max_dollars=None, max_hours=None)
    params = load_params(None)
    s = score(spec.model, spec.cluster, spec.workload, budget, params, spec.goodput)
    assert s.selection.selected is not None
    record = expert_parallelism(
        s, s.selection.selected, spec.model, spec.workload, budget, params, spec.goodput
    )
    assert record is not None and len(record.families) >= 4
    speeds = [f.tokens_per_s for f in record.families]
    assert speeds == sorted(speeds, reverse=True)
