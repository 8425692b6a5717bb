"""`allowed_values`: what an error offers instead of a bad tp / pp / cp is exactly what `plan_problem`
accepts for that field (checked against every candidate, and against counts worked out by hand)."""

from __future__ import annotations

import pytest

from service.catalog import load_gpu, load_model
from service.spec import ClusterSpec, Plan, plan_problem
from service.spec.plan_checks import allowed_values

MODEL = load_model("llama2-13b")  # 40 layers, 40 heads (40 KV heads)
CLUSTER = ClusterSpec(gpu=load_gpu("h100-sxm-80gb"), num_nodes=4, gpus_per_node=8)


def test_the_values_worked_out_by_hand() -> None:
    plan = Plan(dp=32, zero_stage=1)
    # tp: divides the 40 heads and the 8 GPUs of a node
    assert allowed_values("tp", plan, MODEL, CLUSTER) == [1, 2, 4, 8]
    # pp: divides the 32 GPUs and is at most the 40 layers (uneven stages are allowed)
    assert allowed_values("pp", plan, MODEL, CLUSTER) == [1, 2, 4, 8, 16, 32]
    # 4 virtual stages per rank (Megatron's interleaved schedule) need pp > 1 and pp·4 ≤ 40 layers
    interleaved = Plan(dp=16, pp=2, virtual_stages=4, engine="megatron")
    assert allowed_values("pp", interleaved, MODEL, CLUSTER) == [2, 4, 8]


@pytest.mark.parametrize("field", ["tp", "pp", "cp"])
def test_every_listed_value_passes_on_its_field_and_every_other_fails(field: str) -> None:
    plan = Plan(dp=16, tp=2, zero_stage=1, sequence_parallel=True)
    listed = set(allowed_values(field, plan, MODEL, CLUSTER))
    assert listed  # the plan's own value at least
    assert getattr(plan, field) in listed
    for value in range(1, 65):
        values = {**plan.model_dump(), field: value}
        width = values["tp"] * values["pp"] * values["cp"]
        values["dp"] = max(1, CLUSTER.num_gpus // width)
        problem = plan_problem(Plan.model_construct(**values), MODEL, CLUSTER)
        blamed = problem is not None and problem[0] in {field, "dp", "virtual_stages"}
        assert (value in listed) == (not blamed), (value, problem)


def test_a_field_that_is_not_a_layout_field_is_refused() -> None:
    with pytest.raises(ValueError, match="field must be one of"):
        allowed_values("micro_batch", Plan(dp=32), MODEL, CLUSTER)
