"""The bounded ranking (service/plans/bound.py): the bound holds for every plan, and pruning with it
selects, ties and orders the top plans exactly as the exhaustive ranking does."""

from __future__ import annotations

import numpy as np
import pytest

from service.catalog import load_model
from service.costmodel import estimate_table
from service.planner import Planner, rank_plans
from service.plans.bound import PRUNED_STATUS, structure_bound_s
from service.plans.enumerate import expand_structures
from service.spec import Budget, ClusterSpec, Workload, load_experiment
from service.spec.params import load_params

ENGINES = ("deepspeed", "megatron", "fsdp")
PRECISIONS = ("bf16", "fp8")


def _space(name: str, nodes: int, seq_len: int = 4096) -> tuple:
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=nodes)
    workload = Workload(seq_len=seq_len, global_batch_sequences=512, tokens_to_train=1e11)
    return load_model(name), cluster, workload


SPACES = [("llama2-13b", 4, 4096), ("llama2-7b", 2, 32768), ("mixtral-8x7b", 8, 4096)]


@pytest.mark.parametrize(("name", "nodes", "seq_len"), SPACES)
def test_no_plan_beats_its_layouts_bound(name: str, nodes: int, seq_len: int) -> None:
    """Every valid plan of dense spaces (ZeRO 0-3, offload, context parallelism at 32K) and a MoE space
    (the 1F1B all-to-all overlap included), every engine, bf16 and fp8, takes at least its structure's
    bound; the bound is not vacuous either."""
    model, cluster, workload = _space(name, nodes, seq_len)
    params = load_params()
    found = expand_structures(model, cluster, workload, 64, PRECISIONS, engines=ENGINES)
    bound = structure_bound_s(model, cluster, workload, found.structures, 64, PRECISIONS, params)
    step = estimate_table(model, cluster, workload, found.plans(), params=params).step_time_s
    per_plan = bound[found.plan_structures()]
    assert np.all(step >= per_plan * (1 - 1e-9))
    best = np.full(len(bound), np.inf)
    np.minimum.at(best, found.plan_structures(), step)
    assert np.median(per_plan / step) > 0.5  # a bound close enough to prune on


def _labels(ranking, rows) -> list[str]:
    return [ranking.enumeration.plans.row(int(r)).short() for r in rows]


@pytest.mark.parametrize("objective", ["throughput", "cost"])
def test_the_bounded_ranking_selects_ties_and_orders_the_top_as_the_exhaustive_one(objective: str) -> None:
    """Mixtral 8x7B on 64 H100s with a deadline and checkpoint-aware hours (goodput): the pruned ranking
    scores a fraction of the plans and gives the same choice, tie group and top 10."""
    model, cluster, workload = _space("mixtral-8x7b", 8)
    spec = load_experiment("experiments/llama2-13b-32xh100.yaml")
    budget = Budget(objective=objective, max_hours=400.0)
    kwargs = dict(precision=PRECISIONS, engines=ENGINES, goodput=spec.goodput)
    full = rank_plans(model, cluster, workload, budget, **kwargs)
    pruned = rank_plans(model, cluster, workload, budget, prune=True, keep_top=10, **kwargs)
    assert full.pruning is None and pruned.pruning is not None
    assert pruned.pruning.plans > len(pruned.enumeration.plans)  # most plans never scored
    sel_full, sel_pruned = full.selection, pruned.selection
    assert _labels(pruned, [sel_pruned.selected]) == _labels(full, [sel_full.selected])
    assert sorted(_labels(pruned, sel_pruned.ties)) == sorted(_labels(full, sel_full.ties))
    feasible_full = [r for r in sel_full.order if full.selection.status[r] not in (1, 2, 3)][:10]
    assert _labels(pruned, sel_pruned.order[: len(feasible_full)]) == _labels(full, feasible_full)
    counts = pruned.rejected_counts()
    assert counts[PRUNED_STATUS] + len(pruned.enumeration.plans) == len(full.enumeration.plans)


def test_with_no_feasible_plan_nothing_is_pruned() -> None:
    """A deadline no plan meets: the bound has no incumbent to prune against, so every plan is scored
    and the fallback is the exhaustive ranking's."""
    model, cluster, workload = _space("llama2-13b", 4)
    budget = Budget(objective="throughput", max_hours=0.01)
    full = rank_plans(model, cluster, workload, budget, engines=ENGINES)
    pruned = rank_plans(model, cluster, workload, budget, engines=ENGINES, prune=True)
    assert pruned.pruning is None and pruned.selection.selected is None
    assert len(pruned.enumeration.plans) == len(full.enumeration.plans)
    assert _labels(pruned, [pruned.selection.fallback]) == _labels(full, [full.selection.fallback])


def test_planner_says_why_a_pruned_plan_lost() -> None:
    """`Planner(prune=True)`: the same choice as without, and `why_not` of a plan it never scored names
    its layout's bound against the choice's step time."""
    spec = load_experiment("experiments/llama2-13b-32xh100.yaml")
    exhaustive = Planner(spec, top_k=5).fit()
    pruned = Planner(spec, top_k=5, prune=True).fit()
    assert exhaustive.selected is not None and pruned.selected is not None
    assert pruned.selected.plan == exhaustive.selected.plan
    assert [r.plan for r in pruned.ranked] == [r.plan for r in exhaustive.ranked]
    assert pruned.plans_evaluated < exhaustive.plans_evaluated
    table = exhaustive._ranking.enumeration.plans
    scored = {pruned._ranking.enumeration.plans.row(i) for i in range(len(pruned._ranking.enumeration.plans))}
    slowest = np.argsort(exhaustive._ranking.estimates.step_time_s)[::-1]
    lost = next(table.row(int(r)) for r in slowest if table.row(int(r)) not in scored)
    why = pruned.why_not(lost)
    assert why.startswith("slower (not scored): no plan of its layout beats"), why
    assert exhaustive.why_not(lost).split(":")[0] in ("slower", "over memory", "costlier")
