"""Search-space schema: strict YAML, one-line errors, points, constraints; the shipped spaces load."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from service.search.space import SearchSpace, load_space, space_from_dict
from service.spec import SpecError

REPO = Path(__file__).resolve().parents[2]
SPACES = sorted((REPO / "search_spaces").glob("*.yaml"))


def test_points_are_the_cartesian_product_in_yaml_order() -> None:
    space = space_from_dict(
        {"name": "s", "params": {"zero_stage": [1, 3], "micro_batch": [2, 4, 8], "tp": 1}}
    )
    points = space.points()
    assert len(points) == space.size() == 6
    assert points[0] == {"zero_stage": 1, "tp": 1, "micro_batch": 2}
    assert points[-1] == {"zero_stage": 3, "tp": 1, "micro_batch": 8}
    assert space.mode == "max" and space.direction == "max"  # tokens_per_s is maximised by default


def test_metric_sets_the_default_direction() -> None:
    space = space_from_dict({"name": "s", "params": {"tp": [1]}, "metric": "step_time_s"})
    assert space.direction == "min"


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        (
            {"name": "s", "params": {"tp": [1], "zero": [1]}},
            "params.zero",
            "unknown field; allowed: cp, ep, ep_comm_overlap, expert_tp, grad_accum",
        ),
        ({"name": "s", "params": {}}, "params", "empty space"),
        ({"name": "s", "params": {"tp": []}}, "params", "tp has no values"),
        ({"name": "s", "params": {"dp": [2]}}, "params", "dp is derived"),
        (
            {"name": "s", "params": {"recompute": ["some"]}},
            "params.recompute.0",
            "'none', 'selective' or 'full'",
        ),
        ({"name": "s", "params": {"tp": [0, 2]}}, "params.tp", "positive"),
        ({"name": "s", "params": {"tp": [1]}, "metric": "mfu"}, "metric", "tokens_per_s"),
        ({"name": "s", "params": {"tp": [1]}, "search": {"algorithm": "anneal"}}, "search.algorithm", "grid"),
    ],
)
def test_bad_spaces_are_one_line_spec_errors(data: dict, field: str, words: str) -> None:
    with pytest.raises(SpecError) as info:
        space_from_dict(data, "space.yaml")
    assert info.value.field == field
    assert words in info.value.message
    assert "\n" not in str(info.value) and str(info.value).startswith("space.yaml: ")


def test_empty_yaml_file_is_an_empty_space(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here\n")
    with pytest.raises(SpecError, match="empty space"):
        load_space(path)


def test_constraints_exclude_and_batch_limits() -> None:
    space = space_from_dict(
        {
            "name": "s",
            "params": {"zero_stage": [1, 3], "micro_batch": [1, 4]},
            "constraints": {"exclude": [{"zero_stage": 3, "micro_batch": 4}], "max_sequences_per_step": 4},
        }
    )
    c = space.constraints
    assert c.violation({"zero_stage": 3, "micro_batch": 4}, 8) is not None
    assert "exclude[0]" in (c.violation({"zero_stage": 3, "micro_batch": 4}, 4) or "")
    assert "max_sequences_per_step" in (c.violation({"zero_stage": 1, "micro_batch": 4}, 8) or "")
    assert c.violation({"zero_stage": 1, "micro_batch": 4}, 4) is None


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (
            {"zero_stage": 2, "micro_batch": 4},
            r"exclude\[0\]: zero_stage 2 is not among params.zero_stage \[1, 3\]",
        ),
        (
            {"recompute": "full"},
            r"exclude\[0\]: recompute is not searched \(not in params\): it never matches",
        ),
    ],
)
def test_an_exclude_rule_that_can_never_match_is_refused(rule: dict, message: str) -> None:
    data = {"params": {"zero_stage": [1, 3], "micro_batch": [1, 4]}, "constraints": {"exclude": [rule]}}
    with pytest.raises(SpecError, match=message) as err:
        space_from_dict(data)
    assert err.value.field == "constraints"


def test_yaml_name_defaults_to_the_file_stem(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("params: {micro_batch: [1, 2]}\n")
    assert load_space(path).name == "mine"


@pytest.mark.parametrize("path", SPACES, ids=[p.stem for p in SPACES])
def test_shipped_spaces_are_valid(path: Path) -> None:
    space = load_space(path)
    assert isinstance(space, SearchSpace)
    assert space.size() >= 4


def test_the_required_spaces_are_shipped() -> None:
    names = {p.stem for p in SPACES}
    assert {"tiny-cpu", "llama2-13b-32xh100", "zero-offload-recompute", "microbatch-recompute"} <= names
    zor = load_space(REPO / "search_spaces" / "zero-offload-recompute.yaml").params.varied()
    assert len(zor["zero_stage"]) > 1 and len(zor["offload_optimizer"]) > 1 and len(zor["recompute"]) > 1
    mbr = load_space(REPO / "search_spaces" / "microbatch-recompute.yaml").params.varied()
    assert len(mbr["micro_batch"]) > 1 and len(mbr["recompute"]) > 1


def test_a_space_built_in_python_takes_tune_values_and_settings_beside_params() -> None:
    from ray import tune

    space = SearchSpace(
        params={
            "zero_stage": tune.grid_search([1, 2]),
            "micro_batch": tune.choice([2, 4, 8]),
            "recompute": ("none", "full"),
            "tp": 1,
        },
        constraints={"exclude": [{"zero_stage": 2, "micro_batch": 8}]},
        algorithm="random",
        max_trials=3,
    )
    assert space.params.varied() == {
        "zero_stage": [1, 2],
        "tp": [1],
        "micro_batch": [2, 4, 8],
        "recompute": ["none", "full"],
    }
    assert space.size() == 12 and space.name == "space"
    assert (space.search.algorithm, space.search.max_trials) == ("random", 3)
    assert space.constraints.violation({"zero_stage": 2, "micro_batch": 8}, 16) is not None
    # the same space written as YAML data is the same space
    same = space_from_dict(
        {
            "name": "space",
            "params": {
                "zero_stage": [1, 2],
                "micro_batch": [2, 4, 8],
                "recompute": ["none", "full"],
                "tp": 1,
            },
            "constraints": {"exclude": [{"zero_stage": 2, "micro_batch": 8}]},
            "search": {"algorithm": "random", "max_trials": 3},
        }
    )
    assert same == space


def test_python_space_errors_name_the_problem() -> None:
    from pydantic import ValidationError
    from ray import tune

    with pytest.raises(ValidationError, match="continuous Tune domain"):
        SearchSpace(params={"micro_batch": tune.uniform(1, 8)})
    with pytest.raises(ValidationError, match="algorithm is given twice"):
        SearchSpace(params={"tp": [1]}, algorithm="grid", search={"algorithm": "bayes"})
    with pytest.raises(ValidationError, match=r"'grid', 'random' or 'bayes'"):
        SearchSpace(params={"tp": [1]}, algorithm="anneal")


def test_space_fields_are_derived_from_the_plan_fields_a_proxy_varies() -> None:
    """`ParamSpace` and `PartialPlan` are made from `Plan.model_fields`: every `Plan` field but those in
    `NOT_SEARCHED`, with Plan's own value type and description; naming a field a proxy cannot vary is
    refused with the reason."""
    from typing import get_args

    from service.search.space import NOT_SEARCHED, ParamSpace, PartialPlan, space_from_dict
    from service.spec import Plan

    assert {"dp", "precision", "engine"} <= set(NOT_SEARCHED)
    searched = {name: f for name, f in Plan.model_fields.items() if name not in NOT_SEARCHED}
    assert list(ParamSpace.model_fields) == list(searched)  # Plan's order
    assert list(PartialPlan.model_fields) == list(searched)
    assert {"zero_stage", "tp", "pp", "micro_batch", "grad_accum", "recompute"} <= set(searched)
    for name, field in searched.items():
        assert get_args(ParamSpace.model_fields[name].annotation) == (list[field.annotation], type(None))
        assert get_args(PartialPlan.model_fields[name].annotation) == (field.annotation, type(None))
        assert ParamSpace.model_fields[name].description == field.description
    for name, reason in NOT_SEARCHED.items():
        with pytest.raises(SpecError, match=f"{name} is {re.escape(reason)}"):
            space_from_dict({"params": {"zero_stage": [1], name: [1]}})
    with pytest.raises(SpecError, match="precision is the proxy's own"):
        space_from_dict({"params": {"zero_stage": [1]}, "constraints": {"exclude": [{"precision": "fp32"}]}})
    with pytest.raises(SpecError, match="values must be positive"):
        space_from_dict({"params": {"micro_batch": [2, -1]}})
