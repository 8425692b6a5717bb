"""Plan → DeepSpeed config: every field the plan controls lands where DeepSpeed reads it."""

from __future__ import annotations

import pytest

from service.spec import Plan, ProxySpec
from service.train.ds_config import deepspeed_config, proxy_precision

CPU = ProxySpec(device="cpu", precision="fp32")
CUDA = ProxySpec(device="cuda", precision="bf16")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_and_batch_split(stage):
    plan = Plan(dp=2, zero_stage=stage, micro_batch=3, grad_accum=4)
    cfg = deepspeed_config(plan, CPU)
    assert cfg["zero_optimization"]["stage"] == stage
    assert cfg["train_micro_batch_size_per_gpu"] == 3
    assert cfg["gradient_accumulation_steps"] == 4
    assert cfg["train_batch_size"] == 3 * 4 * 2
    assert "offload_optimizer" not in cfg["zero_optimization"]
    assert cfg["gradient_clipping"] == 1.0


def test_zero3_partitions_every_parameter_of_a_small_proxy():
    cfg = deepspeed_config(Plan(dp=2, zero_stage=3), CPU)
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert (
        "stage3_param_persistence_threshold"
        not in deepspeed_config(Plan(dp=2, zero_stage=2), CPU)["zero_optimization"]
    )


def test_offload_sections():
    plan = Plan(dp=2, zero_stage=3, offload_optimizer=True, offload_params=True)
    zero = deepspeed_config(plan, CPU)["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu"
    assert zero["offload_param"]["device"] == "cpu"
    only_opt = deepspeed_config(Plan(dp=2, zero_stage=1, offload_optimizer=True), CPU)["zero_optimization"]
    assert only_opt["offload_optimizer"]["device"] == "cpu" and "offload_param" not in only_opt


def test_precision_follows_the_device():
    plan = Plan(dp=2, zero_stage=1, precision="bf16")
    cpu = deepspeed_config(plan, CPU)
    assert not cpu["bf16"]["enabled"] and not cpu["fp16"]["enabled"]  # CPU proxies run fp32
    gpu = deepspeed_config(plan, CUDA)
    assert gpu["bf16"]["enabled"] and not gpu["fp16"]["enabled"]
    old_gpu = deepspeed_config(plan, CUDA, bf16_supported=False)
    assert old_gpu["fp16"]["enabled"] and not old_gpu["bf16"]["enabled"]
    assert deepspeed_config(Plan(dp=2, precision="fp16"), CUDA)["fp16"]["enabled"]
    assert proxy_precision(plan, CPU) == "fp32" and proxy_precision(plan, CUDA) == "bf16"
    assert deepspeed_config(plan, ProxySpec(device="cpu", precision="bf16"))["bf16"]["enabled"]


def test_tensor_parallel_uses_autotp_and_leaves_the_batch_to_deepspeed():
    cfg = deepspeed_config(Plan(dp=1, tp=2, zero_stage=1, micro_batch=2, grad_accum=2), CPU)
    assert cfg["tensor_parallel"] == {"autotp_size": 2}
    assert "train_batch_size" not in cfg  # DeepSpeed would check it against the world size
    assert "tensor_parallel" not in deepspeed_config(Plan(dp=2), CPU)


def test_recompute_turns_on_deepspeed_checkpointing_section():
    assert "activation_checkpointing" not in deepspeed_config(Plan(dp=2), CPU)
    for mode in ("selective", "full"):
        assert "activation_checkpointing" in deepspeed_config(Plan(dp=2, recompute=mode), CPU)


def test_pipeline_plan_config_carries_the_micro_batches():
    cfg = deepspeed_config(Plan(dp=1, pp=2, zero_stage=1, micro_batch=2, grad_accum=8), CPU)
    assert cfg["gradient_accumulation_steps"] == 8  # the pipeline engine's micro-batches per step
    assert cfg["train_batch_size"] == 16


def test_optimizer_is_adamw_and_offload_keeps_adamw_semantics():
    assert deepspeed_config(Plan(dp=2), CPU)["optimizer"]["type"] == "AdamW"
    off = deepspeed_config(Plan(dp=2, zero_stage=2, offload_optimizer=True), CPU)
    assert off["optimizer"]["params"]["adam_w_mode"] is True


def test_optimizer_needs_no_compiled_cuda_kernel():
    assert deepspeed_config(Plan(dp=2, zero_stage=1), CUDA)["optimizer"]["params"]["torch_adam"] is True
    off = deepspeed_config(Plan(dp=2, zero_stage=1, offload_optimizer=True), CUDA)["optimizer"]["params"]
    assert "torch_adam" not in off  # DeepSpeedCPUAdam (C++ JIT, no CUDA) runs the offloaded step
