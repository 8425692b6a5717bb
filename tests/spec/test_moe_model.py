"""MoESpec: the expert blocks of a model, its total and active parameters, and the dense view."""

import pytest

from service.spec.model import ModelSpec
from service.spec.moe_spec import MoESpec

# Mixtral 8x7B's config.json (mistralai/Mixtral-8x7B-v0.1): 46.7B parameters, 12.9B active
# (Mistral AI, "Mixtral of experts", 2023, and arXiv 2401.04088 §2).
MIXTRAL = dict(
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    ffn_hidden_size=14336,
    vocab_size=32000,
)


def mixtral(**moe: object) -> ModelSpec:
    fields = {"num_experts": 8, "experts_per_token": 2, "expert_ffn_hidden_size": 14336, **moe}
    return ModelSpec(**MIXTRAL, moe=MoESpec(**fields))


def test_mixtral_total_and_active_parameters() -> None:
    m = mixtral()
    assert m.num_params / 1e9 == pytest.approx(46.70, abs=0.01)
    assert m.active_params / 1e9 == pytest.approx(12.88, abs=0.01)
    assert m.num_moe_layers == 32


def test_dense_view_holds_everything_but_the_routed_experts() -> None:
    m = mixtral()
    view = m.dense_view()
    assert view.moe is None
    assert view.num_params == pytest.approx(m.num_params - m.expert_params, rel=1e-3)
    dense = ModelSpec(**MIXTRAL)
    assert dense.dense_view() is dense and dense.active_params == dense.num_params


def test_moe_layer_pattern_counts_blocks() -> None:
    every_other = MoESpec(num_experts=8, experts_per_token=2, expert_ffn_hidden_size=64, layer_frequency=2)
    assert (
        every_other.num_moe_layers(32) == 16
        and every_other.is_moe_layer(1)
        and not every_other.is_moe_layer(0)
    )
    first_three_dense = MoESpec(
        num_experts=8, experts_per_token=2, expert_ffn_hidden_size=64, first_dense_layers=3
    )
    assert first_three_dense.num_moe_layers(61) == 58
    assert [first_three_dense.is_moe_layer(i) for i in range(4)] == [False, False, False, True]


@pytest.mark.parametrize(
    ("moe", "field"),
    [
        ({"experts_per_token": 9}, "experts_per_token"),
        ({"num_experts": 2**21}, "num_experts"),  # above MAX_EXPERTS: the planner tries its divisors
        ({"router": "capacity"}, "capacity_factor"),
        ({"router": "capacity", "capacity_factor": 0.5}, "capacity_factor"),
        ({"capacity_factor": 1.25}, "capacity_factor"),
        ({"router": "switch"}, "router"),
        ({"first_dense_layers": 32}, "moe.first_dense_layers"),
    ],
)
def test_bad_moe_fields_name_the_field(moe: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        mixtral(**moe)


def test_capacity_router_accepts_a_factor_of_one_or_more() -> None:
    assert mixtral(router="capacity", capacity_factor=1.0).moe.capacity_factor == 1.0
    with pytest.raises(ValueError, match="experts_per_token: 5 exceeds num_experts 4"):
        MoESpec(num_experts=4, experts_per_token=5, expert_ffn_hidden_size=8)


def test_proxy_keeps_a_moe_block_and_scales_expert_width() -> None:
    m = ModelSpec(
        **MIXTRAL,
        moe=MoESpec(num_experts=8, experts_per_token=2, expert_ffn_hidden_size=14336, first_dense_layers=3),
    )
    proxy = m.scaled(num_layers=2, hidden_scale=8)
    assert proxy.num_moe_layers == 1 and proxy.moe.expert_ffn_hidden_size == 14336 // 8


def test_megatron_runs_moe_with_tp_only_with_sequence_parallel():
    """Megatron-LM's arguments.py: 'When using MoE and tensor parallelism, sequence parallelism must be
    used'; the enumeration drops such plans as plan_problem refuses them."""
    from service.catalog import load_model
    from service.spec import Plan
    from service.spec.plan_checks import plan_problem

    qwen = load_model("qwen3-30b-a3b")
    plan = Plan(engine="megatron", dp=4, tp=2, ep=4, micro_batch=1, zero_stage=1)
    assert plan_problem(plan, qwen) == (
        "sequence_parallel",
        "megatron runs MoE blocks with tp > 1 only with sequence_parallel on",
    )
    assert plan_problem(plan.model_copy(update={"sequence_parallel": True}), qwen) is None
    dense = Plan(engine="megatron", dp=4, tp=2, micro_batch=1, zero_stage=1)
    assert plan_problem(dense, load_model("llama2-7b")) is None  # a dense model's blocks: no such rule
