"""Model-guided pruning: invalid, constraint and predicted-OOM plans are pruned with reasons; the rest
are ordered by the cost model's prediction (real cost model, tiny CPU and 13B experiments)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.search.prune import plan_for_point, prune_space
from service.search.space import load_space, space_from_dict
from service.spec import load_experiment
from service.train.proxy_scale import predict_proxy

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    return load_experiment(REPO / "experiments" / "tiny-cpu.yaml")


def test_dp_fills_the_proxy_workers_and_precision_is_the_proxys(tiny) -> None:
    plan = plan_for_point(tiny, {"tp": 2, "zero_stage": 1})
    assert (plan.dp, plan.tp, plan.pp) == (1, 2, 1)
    assert plan.precision == tiny.proxy.precision == "fp32"
    assert plan_for_point(tiny, {"zero_stage": 1}).dp == 2


def test_each_kind_of_pruning_has_its_reason(tiny) -> None:
    space = space_from_dict(
        {
            "name": "p",
            "params": {
                "zero_stage": [0, 1],
                "offload_optimizer": [False, True],
                "tp": [1, 4],
                "micro_batch": [2, 8192],
            },
            "constraints": {"exclude": [{"zero_stage": 1, "micro_batch": 2, "offload_optimizer": True}]},
        }
    )
    result = prune_space(tiny, space)
    assert result.size == space.size() == 16
    by_kind: dict[str, list] = {}
    for p in result.pruned:
        by_kind.setdefault(p.kind, []).append(p)
    # ZeRO-0 with optimizer offload: Plan's own rule, before any plan exists.
    assert any(
        "optimizer offload needs zero_stage" in p.reason and p.plan is None for p in by_kind["invalid"]
    )
    # tp 4 on 2 workers: dp·tp·pp != workers, decided by proxy_plan_problem.
    assert any("but the proxy has 2 workers" in p.reason for p in by_kind["invalid"])
    assert [p.point for p in by_kind["constraint"]] == [
        {"zero_stage": 1, "offload_optimizer": True, "tp": 1, "micro_batch": 2}
    ]
    # micro-batch 8192 of 64 tokens: ~30 GiB of activations on a 24 GiB "device".
    assert by_kind["predicted_oom"] and all(p.plan.micro_batch == 8192 for p in by_kind["predicted_oom"])
    assert all("predicted not to fit" in p.reason for p in by_kind["predicted_oom"])
    assert {c.plan.micro_batch for c in result.candidates} == {2}
    assert len(result.candidates) == 2  # z0 and z1 (no offload), tp 1, mb 2


def test_candidates_are_in_predicted_order_and_unguided_keeps_space_order(tiny) -> None:
    space = load_space(REPO / "search_spaces" / "tiny-cpu.yaml")
    guided = prune_space(tiny, space)
    values = [c.predicted_value for c in guided.candidates]
    assert values == sorted(values, reverse=True) and len(values) == 16
    for c in guided.candidates[:3]:  # the prediction stored is the cost model's, not a copy of something else
        assert c.predicted.as_dict() == pytest.approx(predict_proxy(tiny, c.plan).as_dict())
    plain = prune_space(tiny, space, guided=False)
    assert {c.key for c in plain.candidates} == {c.key for c in guided.candidates}
    keys_in_space_order = [c.key for c in plain.candidates]
    assert keys_in_space_order != [c.key for c in guided.candidates]
    assert keys_in_space_order[0].startswith("dp2-tp1-pp1-z0-mb1")


def test_unguided_launches_predicted_oom_plans() -> None:
    tiny = load_experiment(REPO / "experiments" / "tiny-cpu.yaml")
    space = space_from_dict({"name": "p", "params": {"micro_batch": [2, 8192]}})
    assert len(prune_space(tiny, space).candidates) == 1
    assert len(prune_space(tiny, space, guided=False).candidates) == 2


def test_min_metric_orders_ascending() -> None:
    tiny = load_experiment(REPO / "experiments" / "tiny-cpu.yaml")
    space = space_from_dict(
        {"name": "p", "params": {"micro_batch": [1, 4, 16]}, "metric": "peak_memory_bytes_per_rank"}
    )
    values = [c.predicted_value for c in prune_space(tiny, space).candidates]
    assert values == sorted(values) and values[0] < values[-1]


def test_13b_space_prunes_and_keeps_hundreds() -> None:
    exp = load_experiment(REPO / "experiments" / "llama2-13b-32xh100.yaml")
    result = prune_space(exp, load_space(REPO / "search_spaces" / "llama2-13b-32xh100.yaml"))
    kinds = {p.kind for p in result.pruned}
    assert kinds == {"invalid", "constraint", "predicted_oom"}
    assert len(result.candidates) > 100
    assert all(c.plan.num_gpus == exp.proxy.num_workers == 8 for c in result.candidates)


def test_saved_pruning_keeps_typed_predictions_and_reads_an_older_state(tiny) -> None:
    import json

    from service.search.prune import pruning_from_json, pruning_to_json

    space = space_from_dict({"name": "s", "params": {"zero_stage": [1], "micro_batch": [2, 8192]}})
    pruned = prune_space(tiny, space)
    saved = json.loads(json.dumps(pruning_to_json(pruned)))
    assert "tokens_per_s" in saved["candidates"][0]["predicted"]  # plain quantity names in the state
    again = pruning_from_json(saved)
    assert again.candidates[0].predicted == pruned.candidates[0].predicted
    assert again.pruned[0].predicted.peak_memory_bytes_per_rank > 0
    # A search saved before predictions were typed kept predict_proxy's `predicted_x` keys.
    old = pruned.candidates[0].predicted.prefixed("predicted_")
    saved["candidates"][0]["predicted"] = old
    assert pruning_from_json(saved).candidates[0].predicted == pruned.candidates[0].predicted


def test_a_plan_field_is_searchable_without_restating_it(tiny) -> None:
    """cp came to `Plan` after the search space was written: derived from Plan, the space varies it,
    dp fills the workers left by tp·pp·cp, and a degree the proxy cannot lay out is pruned as invalid."""
    space = space_from_dict({"params": {"zero_stage": [1], "cp": [1, 2, 4], "micro_batch": [2]}})
    result = prune_space(tiny, space)
    assert sorted((c.plan.cp, c.plan.dp) for c in result.candidates) == [(1, 2), (2, 1)]
    assert [(p.plan.cp, p.kind) for p in result.pruned if p.plan] == [(4, "invalid")]
