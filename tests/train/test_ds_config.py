"""Plan → DeepSpeed config: every field the plan controls lands where DeepSpeed reads it."""

from __future__ import annotations

import pytest

from service.costmodel import memory
from service.spec import ModelSpec, Plan, ProxySpec, load_experiment
from service.spec.zero import ZeroKnobs
from service.train.ds_config import deepspeed_config, proxy_precision
from service.train.proxy_scale import proxy_model

CPU = ProxySpec(device="cpu", precision="fp32")
CUDA = ProxySpec(device="cuda", precision="bf16")
MODEL = proxy_model(load_experiment("experiments/tiny-cpu.yaml"))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_and_batch_split(stage):
    plan = Plan(dp=2, zero_stage=stage, micro_batch=3, grad_accum=4)
    cfg = deepspeed_config(plan, CPU, MODEL)
    assert cfg["zero_optimization"]["stage"] == stage
    assert cfg["train_micro_batch_size_per_gpu"] == 3
    assert cfg["gradient_accumulation_steps"] == 4
    assert cfg["train_batch_size"] == 3 * 4 * 2
    assert "offload_optimizer" not in cfg["zero_optimization"]
    assert cfg["gradient_clipping"] == 1.0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_buffers_are_the_knobs_the_cost_model_prices(stage):
    """One source: the buckets and threshold DeepSpeed gets are `ZeroKnobs.for_model`, which the cost
    model's `zero_buffer_elements` and `zero3_persistent_params` read too."""
    big = ModelSpec.model_validate({**MODEL.model_dump(), "hidden_size": 256})  # other values
    for model in (MODEL, big):
        knobs = ZeroKnobs.for_model(model)
        zero = deepspeed_config(Plan(dp=2, zero_stage=stage), CPU, model)["zero_optimization"]
        h = model.hidden_size
        assert zero["reduce_bucket_size"] == knobs.reduce_bucket_elements == h * h
        assert zero["allgather_bucket_size"] == knobs.allgather_bucket_elements == h * h
        if stage == 3:
            assert zero["stage3_param_persistence_threshold"] == knobs.stage3_param_persistence_threshold
            assert zero["stage3_prefetch_bucket_size"] == knobs.stage3_prefetch_bucket_elements
            assert zero["stage3_max_live_parameters"] == knobs.stage3_max_live_parameters
            assert zero["stage3_max_reuse_distance"] == knobs.stage3_max_reuse_distance == 10**9
            # the norms (h elements) stay whole in the run, as the cost model prices them
            assert h < zero["stage3_param_persistence_threshold"]
            assert float(memory.zero3_persistent_params(model, 1, 1)) == (2 * model.num_layers + 1) * h
        else:
            assert "stage3_param_persistence_threshold" not in zero


def test_offload_sections():
    plan = Plan(dp=2, zero_stage=3, offload_optimizer=True, offload_params=True)
    zero = deepspeed_config(plan, CPU, MODEL)["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu"
    assert zero["offload_param"]["device"] == "cpu"
    only_opt = deepspeed_config(Plan(dp=2, zero_stage=1, offload_optimizer=True), CPU, MODEL)[
        "zero_optimization"
    ]
    assert only_opt["offload_optimizer"]["device"] == "cpu" and "offload_param" not in only_opt


def test_precision_follows_the_device():
    plan = Plan(dp=2, zero_stage=1, precision="bf16")
    cpu = deepspeed_config(plan, CPU, MODEL)
    assert not cpu["bf16"]["enabled"] and not cpu["fp16"]["enabled"]  # CPU proxies run fp32
    gpu = deepspeed_config(plan, CUDA, MODEL)
    assert gpu["bf16"]["enabled"] and not gpu["fp16"]["enabled"]
    old_gpu = deepspeed_config(plan, CUDA, MODEL, bf16_supported=False)
    assert old_gpu["fp16"]["enabled"] and not old_gpu["bf16"]["enabled"]
    assert deepspeed_config(Plan(dp=2, precision="fp16"), CUDA, MODEL)["fp16"]["enabled"]
    assert proxy_precision(plan, CPU) == "fp32" and proxy_precision(plan, CUDA) == "bf16"
    assert deepspeed_config(plan, ProxySpec(device="cpu", precision="bf16"), MODEL)["bf16"]["enabled"]


def test_tensor_parallel_is_the_models_own_and_the_batch_is_checked_against_dp():
    """TP is built into the proxy model (Megatron-style layers), not DeepSpeed AutoTP; DeepSpeed reads dp
    from the model's topology, so the batch identity holds with dp, not the world size."""
    cfg = deepspeed_config(Plan(dp=1, tp=2, zero_stage=1, micro_batch=2, grad_accum=2), CPU, MODEL)
    assert "tensor_parallel" not in cfg
    assert cfg["train_batch_size"] == 4
    assert "pipeline" not in cfg


def test_sequence_parallel_pipelines_send_whole_activations():
    sp = Plan(dp=1, tp=2, pp=2, zero_stage=1, sequence_parallel=True, micro_batch=2, grad_accum=2)
    whole = {"pipe_partitioned": False, "grad_partitioned": False}
    assert deepspeed_config(sp, CPU, MODEL)["pipeline"] == whole
    assert "pipeline" not in deepspeed_config(sp.model_copy(update={"sequence_parallel": False}), CPU, MODEL)


def test_recompute_turns_on_deepspeed_checkpointing_section():
    assert "activation_checkpointing" not in deepspeed_config(Plan(dp=2), CPU, MODEL)
    for mode in ("selective", "full"):
        assert "activation_checkpointing" in deepspeed_config(Plan(dp=2, recompute=mode), CPU, MODEL)


def test_pipeline_plan_config_carries_the_micro_batches():
    cfg = deepspeed_config(Plan(dp=1, pp=2, zero_stage=1, micro_batch=2, grad_accum=8), CPU, MODEL)
    assert cfg["gradient_accumulation_steps"] == 8  # the pipeline engine's micro-batches per step
    assert cfg["train_batch_size"] == 16


def test_optimizer_is_adamw_and_offload_keeps_adamw_semantics():
    assert deepspeed_config(Plan(dp=2), CPU, MODEL)["optimizer"]["type"] == "AdamW"
    off = deepspeed_config(Plan(dp=2, zero_stage=2, offload_optimizer=True), CPU, MODEL)
    assert off["optimizer"]["params"]["adam_w_mode"] is True


def test_optimizer_needs_no_compiled_cuda_kernel():
    assert (
        deepspeed_config(Plan(dp=2, zero_stage=1), CUDA, MODEL)["optimizer"]["params"]["torch_adam"] is True
    )
    off = deepspeed_config(Plan(dp=2, zero_stage=1, offload_optimizer=True), CUDA, MODEL)["optimizer"][
        "params"
    ]
    assert "torch_adam" not in off  # DeepSpeedCPUAdam (C++ JIT, no CUDA) runs the offloaded step


def test_hierarchical_zero_reaches_deepspeeds_zero_section():
    """hpZ's keys come from `service.spec.zero.hierarchical_zero_config`, the planner's own mapping."""
    hpz = Plan(dp=4, zero_stage=3, zero_hpz_partition_size=2, precision="fp32")
    assert deepspeed_config(hpz, CPU, MODEL)["zero_optimization"]["zero_hpz_partition_size"] == 2
    assert (
        "zero_hpz_partition_size"
        not in deepspeed_config(Plan(dp=4, zero_stage=3), CPU, MODEL)["zero_optimization"]
    )


def test_what_the_installed_deepspeed_cannot_run_is_refused_before_a_proxy_starts():
    from service.train.proxy_scale import proxy_plan_problem

    exp = load_experiment("experiments/tiny-cpu.yaml")
    four = exp.model_copy(update={"proxy": exp.proxy.model_copy(update={"num_workers": 4})})
    with pytest.raises(ValueError, match="removed MiCS"):  # the deepspeed rule table refuses it first
        Plan(dp=4, zero_stage=3, shard_group_size=2, precision="fp32")
    two = Plan(dp=2, zero_stage=3, zero_quantized_weights=True, precision="fp32")
    assert "no CPU implementation" in proxy_plan_problem(exp, two)
    assert (
        proxy_plan_problem(four, Plan(dp=4, zero_stage=3, zero_hpz_partition_size=2, precision="fp32"))
        is None
    )
